"""Online distillation on traffic the draft was not distilled on: acceptance and tokens/s over time, with the
predict-verify-optimize loop on and off, in the same run.

    python -m bench.online [--minutes 10] [--slice-s 30] [--max-tokens 64] [--model-side]

The demo pair was trained and distilled on the standard library's Python code. The traffic here is English:
the text files that ship with the interpreter but are not library code (IDLE's NEWS, HISTORY, README,
TODO and CREDITS, the licence, the email package's architecture notes, IDLE's help page with its tags
stripped), cut into 64-token prompts, greedy, in one order both sides follow: shuffled with a fixed seed by
default, so the traffic's mix of the files is stationary (in the files' own order the traffic walks from
changelogs to the licence to the help page, and what a version learnt on one genre is judged on the next).

One verify service; two draft services on the same demo draft, one with `--online-distill` and one
without. The run goes in rounds, one slice per draft, one request at a time: the round's first draft (each in
turn) serves the next prompts of the stream for `--slice-s` seconds, and the others then serve the same
prompts, so every side's figures are over the same traffic in the same order. The draft that is not serving is
SIGSTOPped (trainer included), so each side runs on the machine alone and pays for its own trainer: the loop's
cost is in its tokens/s. `--minutes` sets the rounds (minutes x 60 / --slice-s); a side's own traffic time
(`loop_minutes`) is what it spent serving them (the run takes about twice as long, three times with
`--model-side`).

Both default sides choose per round between the suffix trees and the draft model (the draft service's
default), so "loop on" is both halves of the optimize loop: the trees learn from the traffic at once, the
draft over minutes. `--model-side` adds a third side, the loop with the draft model alone
(`--no-enable-suffix-decoding`), served in turn like the others: both halves against each alone.

Then the original domain: the draft weights live at the end of the run and the demo draft as shipped each
speculate in this process (K as above, greedy) on `--heldout-prompts` held-out standard-library prompts: the
other benchmarks' prompts (each held-out file's first 64 tokens), then windows further into the same files.
`heldout` in the JSON gives both acceptances and their difference (the loop must not lose more than 0.02
there), and the same over the first windows alone (`change_first_windows`, the measure of earlier runs).
The loop's side runs the draft service's defaults, so with a draft that ships a rehearsal set (the demo
draft does) a quarter of each training batch rehearses the original domain.

Writes bench/results/online.json and bench/results/online.png: acceptance (accepted / drafted) and tokens/s
per slice, against the loop's traffic time, for both sides, and the weight versions as they go live.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import itertools
import json
import os
import random
import re
import signal
import sysconfig
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import torch
from transformers import AutoTokenizer

from bench.inprocess import heldout_prompts
from bench.load import git_info
from bench.plots import pyplot, save
from bench.services import RESULTS, ROOT, Services
from specmesh.domain import SpecStats
from specmesh.engine import SpeculativeEngine
from specmesh.models import load_model
from specmesh.sampling import SamplingParams
from specmesh.training.online import RehearsalSet
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc

# How many 64-token windows the original-domain measure takes from each held-out standard-library file (20
# files on Python 3.11): with one window per file its noise (about +-0.015 in acceptance) was most of the
# 0.02 the loop may lose there.
HELDOUT_PER_FILE = 4
MODEL_SIDE = "on-model"  # --model-side: the loop with the draft model alone
NO_SUFFIX = "--no-enable-suffix-decoding"

ENGLISH = [
    "idlelib/NEWS.txt",
    "idlelib/NEWS2x.txt",
    "idlelib/HISTORY.txt",
    "idlelib/README.txt",
    "idlelib/TODO.txt",
    "idlelib/CREDITS.txt",
    "LICENSE.txt",
    "email/architecture.rst",
    "idlelib/help.html",
]


def english_prompts(tokenizer, length: int) -> list[list[int]]:
    """Consecutive `length`-token prompts from the English files that ship with the interpreter."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[list[int]] = []
    for name in ENGLISH:
        path = root / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".html":
            text = html.unescape(re.sub(r"<[^>]+>", " ", text))
        text = re.sub(r"[ \t]+", " ", text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.extend(ids[i : i + length] for i in range(0, len(ids) - length, length))
    if not out:
        raise SystemExit(f"none of the English corpus files were found under {root}")
    return out


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[name] = float(value)
    return values


def metrics_port(log: str) -> int:
    m = re.search(r"metrics port (\d+)", log)
    if not m:
        raise RuntimeError(f"no metrics port in the service's log:\n{log[-2000:]}")
    return int(m.group(1))


def serve_slice(
    stub, prompts, cursor: int, seconds: float, max_tokens: int, count: int | None = None, scope: str = ""
) -> tuple[dict, int]:
    """Requests one at a time for `seconds`, or exactly `count` requests when given, in prefix-cache scope
    `scope`; the slice's tokens, time and speculation counters."""
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = drafted = accepted = requests = 0
    busy = 0.0
    end = time.monotonic() + seconds
    while requests < count if count is not None else time.monotonic() < end:
        prompt = prompts[cursor % len(prompts)]
        cursor += 1
        t0 = time.perf_counter()
        req = draft_pb2.DraftServiceGenerateRequest(prompt_ids=prompt, params=params, cache_scope=scope)
        for chunk in stub.Generate(req, timeout=300):
            if chunk.HasField("tokens"):
                tokens += len(chunk.tokens.token_ids)
            elif chunk.HasField("finished"):
                drafted += chunk.finished.stats.drafted
                accepted += chunk.finished.stats.accepted
        busy += time.perf_counter() - t0
        requests += 1
    return {
        "requests": requests,
        "tokens": tokens,
        "seconds": round(busy, 3),
        "tokens_per_s": round(tokens / busy, 2) if busy else None,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": round(accepted / drafted, 4) if drafted else None,
    }, cursor


def heldout_acceptance(args, weights: Path | None) -> dict:
    """Acceptance of the draft (with `weights`, a saved version's state dict, loaded over the demo draft) on
    held-out prompts of the domain it was distilled on, speculating in this process."""
    target, tokenizer = load_model(args.target, "cpu")
    draft, _ = load_model(args.draft, "cpu")
    if weights is not None:
        draft.load_state_dict(torch.load(weights, map_location="cpu"))
    engine = SpeculativeEngine.from_models(target, draft, tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = heldout_prompts(tokenizer, args.heldout_prompts, 64, per_file=HELDOUT_PER_FILE)
    n_files = len(heldout_prompts(tokenizer, args.heldout_prompts, 64))  # they come first, one per file
    stats, first = SpecStats(), SpecStats()
    for i, prompt in enumerate(prompts):
        s = engine.generate(prompt, params, args.k).stats
        stats.merge(s)
        if i < n_files:
            first.merge(s)

    def rate(st: SpecStats) -> dict:
        d = st.as_dict()
        return {
            "drafted": d["drafted"],
            "accepted": d["accepted"],
            "acceptance": round(d["accepted"] / d["drafted"], 4),
        }

    # "first_windows": the opening window of each held-out file alone, the measure before more were taken
    return {"prompts": len(prompts), **rate(stats), "first_windows": rate(first)}


def heldout(args, versions: Path, live: int) -> dict:
    """The original domain before and after the loop: the demo draft against the version live at the end."""
    weights = versions / f"v{live}" / "weights.pt"
    if not weights.is_file():
        raise RuntimeError(f"the loop's live version v{live} was not saved under {versions}")
    before, after = heldout_acceptance(args, None), heldout_acceptance(args, weights)
    out = {"prompts": args.heldout_prompts, "live_version": live, "demo_draft": before, "loop_draft": after}
    out["change"] = round(after["acceptance"] - before["acceptance"], 4)
    out["change_first_windows"] = round(after["first_windows"]["acceptance"] - before["first_windows"]["acceptance"], 4)
    print("held-out original domain:", json.dumps(out), flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(ROOT / "models" / "demo" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "demo" / "draft"))
    ap.add_argument("--minutes", type=float, default=10.0, help="the loop's traffic time (the run takes twice this)")
    ap.add_argument("--slice-s", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per block (fixed, so acceptance is comparable)")
    ap.add_argument("--online-arg", action="append", default=[], help="extra draft flag for the loop's side")
    ap.add_argument(
        "--model-side",
        action="store_true",
        help="a third side: the loop with the draft model alone (--no-enable-suffix-decoding), against the two "
        "default sides, which choose between the suffix trees and the model per round",
    )
    ap.add_argument(
        "--order",
        choices=["shuffled", "files"],
        default="shuffled",
        help="prompt order, the same for both sides: shuffled (seed 0), so the traffic's mix of the files is the "
        "same all along, or the files' own order (each side then walks from one file's genre to the next)",
    )
    ap.add_argument(
        "--heldout-prompts",
        type=int,
        default=80,
        help=f"held-out stdlib prompts (the original domain: up to {HELDOUT_PER_FILE} windows of each held-out file)",
    )
    ap.add_argument("--out", default=str(RESULTS / "online.json"))
    args = ap.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = english_prompts(tokenizer, 64)
    if args.order == "shuffled":
        random.Random(0).shuffle(prompts)
    slices = max(1, round(args.minutes * 60 / args.slice_s))
    threads = ["--threads", str(max(1, (os.cpu_count() or 2) // 2))]
    with tempfile.TemporaryDirectory() as tmp:
        services = Services(Path(tmp))
        try:
            services.spawn("verify", "verify_service", ["--model-path", args.target, *threads])
            verify = services.wait_listening("verify")
            common = ["--model-path", args.draft, "--verify-address", verify, "--no-adaptive", "--no-pipeline"]
            common += ["--speculative-num-steps", str(args.k), *threads]
            online_dir = Path(tmp) / "versions"
            loop_flags = ["--online-distill", "--online-distill-dir", str(online_dir), *args.online_arg]
            services.spawn("on", "draft_service", [*common, *loop_flags])
            services.spawn("off", "draft_service", common)
            names = ["on", "off"]
            if args.model_side:
                model_flags = ["--online-distill", "--online-distill-dir", str(Path(tmp) / "versions-model")]
                services.spawn(MODEL_SIDE, "draft_service", [*common, *model_flags, *args.online_arg, NO_SUFFIX])
                names.append(MODEL_SIDE)
            sides = {name: services.wait_listening(name) for name in names}
            procs = {name: p for name, p, _ in services.procs}
            ports = {name: metrics_port((Path(tmp) / f"{name}.log").read_text()) for name in sides}
            stubs = {name: draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(a)) for name, a in sides.items()}
            rows: list[dict] = []
            cursor = lead_requests = 0
            traffic = dict.fromkeys(names, 0.0)  # each side's own traffic time
            for i in range(len(names) * slices):
                # Lockstep: each round's first side serves for --slice-s seconds and the others serve the
                # same prompts, so every side's tokens/s is over the same traffic in the same order. (With a
                # slice of time each, the faster side got further into the corpus and, once it came round,
                # met its repeats first: the suffix trees accept far more of a repeat, so the bench amplified
                # whatever cost a side paid.) The first side rotates from round to round.
                rnd, j = divmod(i, len(names))
                name = names[(rnd + j) % len(names)]
                for other in names:
                    if other != name:
                        os.kill(procs[other].pid, signal.SIGSTOP)
                os.kill(procs[name].pid, signal.SIGCONT)
                lead = j == 0
                # Each side in a prefix-cache scope of its own: the sides share the verify service, and a side
                # that follows would otherwise find the prompts the round's first side just sent cached.
                count = None if lead else lead_requests
                row, after = serve_slice(stubs[name], prompts, cursor, args.slice_s, args.max_tokens, count, name)
                if lead:
                    lead_requests = row["requests"]
                if j == len(names) - 1:
                    cursor = after
                row["side"] = name
                row["round"] = rnd
                traffic[name] += row["seconds"]
                if name != "off":
                    m = scrape(ports[name])
                    row["version"] = int(m.get("specmesh_draft_online_weights_version", 0))
                    row["updates"] = int(m.get("specmesh_draft_online_updates_total", 0))
                    row["rollbacks"] = int(m.get("specmesh_draft_online_rollbacks_total", 0))
                    row["train_share"] = round(m.get("specmesh_draft_online_train_share", 0.0), 3)
                row["loop_minutes"] = round(traffic[name] / 60, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
            for p in procs.values():
                os.kill(p.pid, signal.SIGCONT)
        finally:
            for _, p, _ in services.procs:
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
            services.close()  # stops the trainer: the versions on disk are final
        live = next((r["version"] for r in reversed(rows) if r["side"] == "on"), 0)  # rolled back = its parent
        original = heldout(args, online_dir, live)
    result = summarize(args, rows, len(prompts))
    result["heldout"] = original
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    plot(result, Path(args.out).with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))
    return result


def _rate(rows: list[dict], key_num: str, key_den: str) -> float | None:
    num, den = sum(r[key_num] for r in rows), sum(r[key_den] for r in rows)
    return round(num / den, 4) if den else None


def summarize(args, rows: list[dict], n_prompts: int) -> dict:
    on = [r for r in rows if r["side"] == "on"]
    off = [r for r in rows if r["side"] == "off"]
    model = [r for r in rows if r["side"] == MODEL_SIDE]
    third = max(1, len(on) // 3)
    half = max(1, len(on) // 2)
    summary = {
        "acceptance_off": _rate(off, "accepted", "drafted"),
        "acceptance_on_first_third": _rate(on[:third], "accepted", "drafted"),
        "acceptance_on_last_third": _rate(on[-third:], "accepted", "drafted"),
        "acceptance_off_last_third": _rate(off[-third:], "accepted", "drafted"),
        "tokens_per_s_on_last_half": _rate(on[-half:], "tokens", "seconds"),
        "tokens_per_s_off_last_half": _rate(off[-half:], "tokens", "seconds"),
        "versions": max((r.get("version", 0) for r in on), default=0),
        "updates": max((r.get("updates", 0) for r in on), default=0),
        "rollbacks": max((r.get("rollbacks", 0) for r in on), default=0),
        "loop_minutes": on[-1]["loop_minutes"] if on else 0,
    }
    a_on, a_off = summary["acceptance_on_last_third"], summary["acceptance_off_last_third"]
    summary["acceptance_gain_last_third"] = round(a_on - a_off, 4) if a_on is not None and a_off is not None else None
    # The figure: loop on minus loop off over the last half of the loop's traffic (5 of 10 minutes).
    h_on, h_off = _rate(on[-half:], "accepted", "drafted"), _rate(off[-half:], "accepted", "drafted")
    summary["acceptance_gain"] = round(h_on - h_off, 4) if h_on is not None and h_off is not None else None
    t_on, t_off = summary["tokens_per_s_on_last_half"], summary["tokens_per_s_off_last_half"]
    summary["tokens_per_s_ratio_last_half"] = round(t_on / t_off, 3) if t_on and t_off else None
    if model:
        # Both halves of the loop (suffix trees + distillation) against distillation alone.
        summary["acceptance_model_last_half"] = _rate(model[-half:], "accepted", "drafted")
        t_model = summary["tokens_per_s_model_last_half"] = _rate(model[-half:], "tokens", "seconds")
        summary["tokens_per_s_on_over_model_last_half"] = round(t_on / t_model, 3) if t_on and t_model else None
    return {
        "bench": "online",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_info(),
        "corpus": {"files": ENGLISH, "prompts": n_prompts, "prompt_tokens": 64},
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        # The loop's side runs --online-distill-rehearsal auto unless an --online-arg says otherwise.
        "rehearsal_set_beside_draft": (Path(args.draft) / RehearsalSet.FILE).is_file(),
        "summary": summary,
        "slices": rows,
    }


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"on": "loop on", "off": "loop off", MODEL_SIDE: "loop on, draft model alone (no suffix trees)"}
    for side, style in (("on", "o-"), ("off", "s--"), (MODEL_SIDE, "^:")):
        rows = [x for x in r["slices"] if x["side"] == side]
        if not rows:
            continue
        xs = [x["loop_minutes"] for x in rows]
        ax1.plot(xs, [x["acceptance"] for x in rows], style, label=labels[side])
        ax2.plot(xs, [x["tokens_per_s"] for x in rows], style, label=labels[side])
    swaps = [x for x in r["slices"] if x["side"] == "on"]
    for prev, cur in itertools.pairwise(swaps):
        if cur.get("version", 0) != prev.get("version", 0):
            ax1.axvline(cur["loop_minutes"], color="grey", alpha=0.3)
    ax1.set_xlabel("each side's traffic time (min)")
    ax1.set_ylabel("acceptance (accepted / drafted)")
    ax2.set_xlabel("each side's traffic time (min)")
    ax2.set_ylabel("tokens/s (one stream)")
    ax1.legend()
    ax2.legend()
    ax1.set_title("English traffic, demo pair distilled on code")
    save(fig, path)


if __name__ == "__main__":
    main()
