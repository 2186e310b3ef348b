"""What `specmesh profile` measures: a workload through the REST API, and the services' /metrics around it.

Each phase runs `concurrency` client threads for a set time, each sending completions back to back; every
response's `specmesh` object (rounds, drafted, accepted) is kept. Every service's /metrics is scraped just
before and just after the phase (after its last request has finished), so counter differences belong to
the phase alone: that is why the profiler wants the stack to itself while it runs. The verify services'
are also read every `PEAK_INTERVAL_S` during the phase, for the highest value each gauge reached (KV blocks
in use fall back once the phase's requests have ended).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from specmesh.stack import stack_file

Sample = dict[tuple[str, tuple[tuple[str, str], ...]], float]
PEAK_INTERVAL_S = 0.5

# Code, as the demo models were trained on (the Python standard library), and a few plain-text requests.
BUILTIN_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_csv_line(line, sep=','):\n",
    'def read_config(path):\n    """Read a key = value file into a dict."""\n',
    "import json\n\n\ndef load(path):\n",
    "def binary_search(items, target):\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "def merge_sorted(a, b):\n",
    "import re\n\nWORD = re.compile(",
    "def is_prime(n):\n",
    "    def __repr__(self):\n        return ",
    "def flatten(nested):\n    result = []\n",
    "try:\n    import threading\nexcept ImportError:\n",
    "def main(argv=None):\n    parser = argparse.ArgumentParser(",
    "def quicksort(items):\n",
]


def load_prompts(path: str) -> list[str]:
    """One prompt per line, or JSONL objects with a "prompt" (or "text") field; blank lines skipped."""
    if not path:
        return list(BUILTIN_PROMPTS)
    prompts = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            obj = json.loads(line)
            prompts.append(str(obj.get("prompt", obj.get("text", ""))))
        else:
            prompts.append(line.replace("\\n", "\n"))
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"{path}: no prompts in it")
    return prompts


# --- /metrics ---------------------------------------------------------------------------------------------
def parse_metrics(text: str) -> Sample:
    out: Sample = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def scrape(url: str, timeout: float = 5.0) -> Sample:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def total(sample: Sample, name: str, **labels: str) -> float:
    """Sum of every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in sample.items() if n == name and want <= set(lab))


def by_label(sample: Sample, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, lab), v in sample.items():
        if n == name:
            key = dict(lab).get(label)
            if key is not None:
                out[key] = out.get(key, 0.0) + v
    return out


def diff(after: Sample, before: Sample) -> Sample:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


@dataclass
class Endpoint:
    name: str  # "verify-0", "draft-0", "gateway", or the role when given by --metrics-url
    role: str  # "verify" | "draft" | "gateway"
    url: str


def discover(url: str, flags: list[str]) -> tuple[list[Endpoint], dict]:
    """The services' /metrics: from --metrics-url ROLE=URL flags, else from the record `specmesh serve` keeps
    for this REST port, else the gateway's own. Returns them and the stack's record ({} if none)."""
    if flags:
        endpoints = []
        for i, flag in enumerate(flags):
            role, sep, where = flag.partition("=")
            if not sep or role not in ("verify", "draft", "gateway"):
                raise ValueError(f"--metrics-url {flag}: expected verify=URL, draft=URL or gateway=URL")
            endpoints.append(Endpoint(f"{role}-{i}", role, where))
        if not any(e.role == "gateway" for e in endpoints):
            endpoints.append(Endpoint("gateway", "gateway", url.rstrip("/") + "/metrics"))
        return endpoints, {}
    port = urllib.parse.urlsplit(url).port or 80
    record_path = stack_file(port)
    if record_path.is_file():
        record = json.loads(record_path.read_text())
        if urllib.parse.urlsplit(record["url"]).port == port and _alive(record.get("launcher_pid", 0)):
            return [
                Endpoint(s["name"], s["role"], s["metrics_url"]) for s in record["services"] if s["metrics_url"]
            ], record
    return [Endpoint("gateway", "gateway", url.rstrip("/") + "/metrics")], {}


def _alive(pid: int) -> bool:
    """Whether the launcher that wrote a stack record still runs (a SIGKILLed one leaves its record behind)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def scrape_all(endpoints: list[Endpoint]) -> dict[str, Sample]:
    out = {}
    for e in endpoints:
        try:
            out[e.name] = scrape(e.url)
        except OSError:  # a service that went away: its numbers are missing, the report says so
            out[e.name] = {}
    return out


# --- the workload -----------------------------------------------------------------------------------------
@dataclass
class Result:
    latency: float
    completion_tokens: int
    stats: dict  # the response's `specmesh` object


@dataclass
class Phase:
    name: str  # "baseline" (target-only) or "c4" (4 concurrent streams)
    concurrency: int
    speculative: bool
    wall: float = 0.0
    results: list[Result] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    before: dict[str, Sample] = field(default_factory=dict)
    after: dict[str, Sample] = field(default_factory=dict)
    peak: dict[str, Sample] = field(default_factory=dict)  # the verify services' highest values in the phase
    sent: int = 0  # requests sent: the prompts cycled from the first, in order (what prefix caching saw)

    def delta(self, name: str) -> Sample:
        return diff(self.after.get(name, {}), self.before.get(name, {}))

    def highest(self, name: str) -> Sample:
        """Endpoint `name`'s highest value of each series: sampled during the phase, and at its end."""
        out = dict(self.after.get(name, {}))
        for k, v in self.peak.get(name, {}).items():
            out[k] = max(v, out.get(k, v))
        return out


class Client:
    def __init__(self, url: str, model: str, api_key: str = "", timeout: float = 300.0):
        self.url = url.rstrip("/")
        self.model = model
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def get(self, path: str) -> dict:
        req = urllib.request.Request(self.url + path, headers=self.headers)
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read())

    def complete(self, prompt: str, max_tokens: int, k: int | None) -> Result:
        body: dict = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        if k is not None:
            body["num_speculative_tokens"] = k
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(), self.headers)
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            answer = json.loads(r.read())
        return Result(time.perf_counter() - t0, answer["usage"]["completion_tokens"], answer.get("specmesh") or {})


def first_model(client: Client) -> str:
    models = client.get("/v1/models")["data"]
    if not models:
        raise ValueError("the gateway lists no model")
    return models[0]["id"]


def run_phase(
    client: Client,
    endpoints: list[Endpoint],
    phase: Phase,
    prompts: list[str],
    seconds: float,
    max_tokens: int,
) -> Phase:
    """`phase.concurrency` streams of back-to-back requests for `seconds`; metrics scraped around it."""
    k = None if phase.speculative else 0
    cycle = itertools.cycle(prompts)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def worker() -> None:
        first = True  # every stream sends at least one request, however slow the stack
        while first or time.monotonic() < deadline:
            first = False
            with lock:
                prompt = next(cycle)
                phase.sent += 1
            try:
                result = client.complete(prompt, max_tokens, k)
            except (OSError, KeyError, ValueError) as e:
                detail = e.read().decode()[:200] if isinstance(e, urllib.error.HTTPError) else str(e)
                with lock:
                    phase.errors.append(f"{type(e).__name__}: {detail}")
                time.sleep(0.2)
                continue
            with lock:
                phase.results.append(result)

    done = threading.Event()

    def sample_peaks() -> None:
        while not done.wait(PEAK_INTERVAL_S):
            for e in endpoints:
                if e.role != "verify":
                    continue
                try:
                    sample = scrape(e.url)
                except OSError:
                    continue
                peak = phase.peak.setdefault(e.name, {})
                for k, v in sample.items():
                    peak[k] = max(v, peak.get(k, v))

    phase.before = scrape_all(endpoints)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(phase.concurrency)]
    sampler = threading.Thread(target=sample_peaks, daemon=True)
    for t in [*threads, sampler]:
        t.start()
    for t in threads:
        t.join()
    phase.wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    phase.after = scrape_all(endpoints)
    return phase
