"""A client of the gateway in a process of its own: it streams long completions and probes /health/live, and
reports the worst gap between each stream's events and the worst probe latency.

Run apart from the services under test, its threads share no GIL with them, so what it measures is the
gateway's answer, not the test process's own contention. Usage: `python -m tests.support.stream_probe PORT
STREAMS`; it prints "ready" once every stream has its first event, and when its stdin is closed prints the
figures as one JSON object ({"gaps": [[s, ...] per stream], "latencies": [s, ...]}) and exits. Standard library
only, so it starts at once.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time


def stream_gaps(
    port: int,
    prompt: str,
    gaps: list[float],
    started: threading.Event,
    measuring: threading.Event,
    done: threading.Event,
) -> None:
    """Stream a long completion, recording the time between consecutive events while `measuring`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "demo", "prompt": prompt, "max_tokens": 1000, "temperature": 0, "stream": True}
    conn.request(
        "POST", "/v1/completions", json.dumps({**body, "ignore_eos": True}), {"content-type": "application/json"}
    )
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"stream refused: {r.status} {r.read()[:200]!r}")
    last = None
    while not done.is_set():
        line = r.fp.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if not line.startswith(b"data:"):
            continue
        now = time.perf_counter()
        if last is not None and measuring.is_set():
            gaps.append(now - last)
        last = now
        started.set()
    conn.close()


def probe_live(port: int, latencies: list[float], done: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    while not done.is_set():
        t0 = time.perf_counter()
        conn.request("GET", "/health/live")
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError(f"/health/live answered {r.status}")
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.01)
    conn.close()


def main(port: int, streams: int) -> None:
    done, measuring = threading.Event(), threading.Event()
    started = [threading.Event() for _ in range(streams)]
    gaps: list[list[float]] = [[] for _ in range(streams)]
    latencies: list[float] = []
    threads = [
        threading.Thread(
            target=stream_gaps, args=(port, f"def f{i}(x):\n", gaps[i], started[i], measuring, done), daemon=True
        )
        for i in range(streams)
    ]
    for t in threads:
        t.start()
    for e in started:
        if not e.wait(60):
            raise RuntimeError("a stream did not start")
    prober = threading.Thread(target=probe_live, args=(port, latencies, done), daemon=True)
    prober.start()
    measuring.set()
    print("ready", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    done.set()
    for t in [*threads, prober]:
        t.join(30)
    print(json.dumps({"gaps": gaps, "latencies": latencies}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
