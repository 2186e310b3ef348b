"""`specmesh`: the command line (also `python -m specmesh`).

    specmesh serve --model-path T --speculative-draft-model-path D [--port 8000] [--grpc-port 50070] ...
    specmesh serve --model-path T --speculative-algorithm ngram ...
    specmesh profile --url http://127.0.0.1:8000 [--duration 60] [--concurrency 1,4,16] [--out DIR]

`serve` starts the verify service(s), the draft service(s) and the gateway as separate processes
(specmesh.stack), `profile` drives a workload through a running stack and writes an optimization report
(specmesh.profile). SGLang's launcher spellings are accepted where they mean the same thing (`--model`,
`--draft-model`, `--speculative-algorithm EAGLE|STANDALONE|NGRAM`, `--tp 1`, `--dp N`,
`--served-model-name`, `--context-length`, ...); those that specmesh cannot honour are refused with the
reason rather than ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from specmesh.placement import add_thread_flags

API_KEY_ENV = "SPECMESH_API_KEY"

# SGLang's speculative algorithms and what each means here.
ALGORITHMS = {
    "standalone": "standalone",  # a separate, smaller draft model: what the draft service runs
    "eagle": "standalone",  # SGLang's EAGLE needs a draft; a full draft model stands in for its head
    "eagle3": "standalone",
    "ngram": "ngram",
}
REFUSED_ALGORITHMS = {
    "nextn": "multi-token-prediction heads (NEXTN) live inside the target; specmesh drafts with a separate "
    "model (--speculative-draft-model-path) or --speculative-algorithm ngram",
    "lookahead": "use --speculative-algorithm ngram (prompt lookup)",
}


class UsageError(Exception):
    """A flag combination specmesh refuses: shown as one line, exit code 2."""


def _serve_parser(sub) -> argparse.ArgumentParser:
    ap = sub.add_parser(
        "serve",
        help="start verify, draft and gateway as separate processes and serve until Ctrl-C",
        description="Start the verify service(s), the draft service(s) and the gateway as separate processes, wait "
        "until all are healthy, print the endpoints, serve until Ctrl-C / SIGTERM (which stops them all). "
        "SGLang's launcher spellings are accepted where they mean the same thing.",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = ap.add_argument_group("models")
    m.add_argument(
        "--model-path", "--model", "--target-model", dest="model_path", help="target checkpoint directory (local HF)"
    )
    m.add_argument(
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        "--draft-model-path",
        "--draft-model",
        dest="draft_model_path",
        help="draft checkpoint directory (same tokenizer as the target)",
    )
    m.add_argument(
        "--speculative-algorithm",
        type=str.lower,
        default=None,
        help="standalone (a draft model; SGLang's EAGLE, EAGLE3 and STANDALONE mean this here) or ngram (prompt "
        "lookup, no draft model); default: standalone when a draft model is given",
    )
    m.add_argument(
        "--speculative-num-steps", type=int, default=None, help="most draft tokens per block, K (draft's default: 4)"
    )
    m.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        help="SGLang's chain spelling of K + 1 (draft tokens including the verified root)",
    )
    m.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="vLLM: new requests decode target-only while more than this many run per verify replica (0 = never; "
        "default: by device, see specmesh.placement)",
    )
    m.add_argument("--speculative-eagle-topk", type=int, default=None, help="SGLang's tree width: only 1 (a chain)")
    m.add_argument(
        "--served-model-name", "--model-name", dest="model_name", default="", help="the model id clients send"
    )
    n = ap.add_argument_group("network")
    n.add_argument("--host", default="127.0.0.1", help="REST and gRPC address of the gateway (0.0.0.0: all)")
    n.add_argument("--port", type=int, default=8000, help="REST port (OpenAI-compatible API)")
    n.add_argument("--grpc-port", type=int, default=50070, help="gateway gRPC port (-1 = off)")
    n.add_argument(
        "--api-key-file",
        default="",
        help=f"file with the API keys clients must send (one per line or comma-separated); or set {API_KEY_ENV}",
    )
    n.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: keys never go on a command line
    r = ap.add_argument_group("placement")
    r.add_argument("--verify-replicas", type=int, default=None, help="verify service processes (default 1)")
    r.add_argument("--draft-replicas", type=int, default=None, help="draft service processes (default 1)")
    r.add_argument("--dp-size", "--dp", dest="dp_size", type=int, default=None, help="SGLang: replicas of both")
    r.add_argument("--tp-size", "--tp", dest="tp_size", type=int, default=1, help="SGLang: tensor parallelism (only 1)")
    r.add_argument("--device", default=None, help="torch device of the models (default: cuda when available)")
    r.add_argument("--draft-device", default=None, help="torch device of the draft, if not --device")
    add_thread_flags(r)
    s = ap.add_argument_group("service settings")
    s.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="SGLang: GPU memory fraction for weights + KV cache; here the verify service's KV budget (GPU only)",
    )
    s.add_argument("--context-length", type=int, default=None, help="SGLang: the verify service's --max-model-len")
    s.add_argument("--max-running-requests", type=int, default=None, help="SGLang: the gateway's --max-concurrency")
    s.add_argument("--random-seed", type=int, default=None, help="SGLang: the verify service's --seed")
    s.add_argument("--log-level", default=None, help="logging level of every service")
    for role in ("verify", "draft", "gateway"):
        s.add_argument(
            f"--{role}-arg",
            dest=f"{role}_args",
            action="append",
            default=[],
            metavar="FLAG",
            help=f"a flag for the {role} service, passed through (repeatable): --{role}-arg=--flag=value "
            f"(`python -m {role}{'_service' if role != 'gateway' else ''} --help` lists them)",
        )
    o = ap.add_argument_group("launcher")
    o.add_argument(
        "--first-request",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send one request once up and show its answer",
    )
    o.add_argument("--smoke", action="store_true", help="stop again after the first answer (CI)")
    o.add_argument("--startup-timeout-s", type=float, default=600.0, help="longest a service may take to start")
    return ap


def _profile_parser(sub) -> argparse.ArgumentParser:
    ap = sub.add_parser(
        "profile",
        help="drive a workload through a running stack and write an optimization report",
        description="Drive a workload through a running stack's REST API at each concurrency, read the services' "
        "/metrics and every response's speculation stats, and write report.md and report.html (with PNG plots) "
        "ending with ranked recommendations.",
        allow_abbrev=False,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's REST address")
    ap.add_argument(
        "--duration", type=float, default=60.0, help="seconds of workload in all (split over the concurrencies)"
    )
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent streams")
    ap.add_argument("--prompts", default="", help="prompts file: one per line, or JSONL with a 'prompt' field")
    ap.add_argument("--out", default="profile-report", help="directory for report.md, report.html and the plots")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--model", default="", help="model id to send (default: the gateway's first model)")
    ap.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="a service's /metrics (verify=URL, draft=URL, gateway=URL; repeatable); default: the stack's own "
        "record when `specmesh serve` runs it on this machine",
    )
    ap.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure target-only decoding (num_speculative_tokens 0) for the speedup",
    )
    ap.add_argument("--api-key-file", default="", help=f"file with an API key to send; or set {API_KEY_ENV}")
    return ap


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specmesh", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    _profile_parser(sub)
    return ap


def read_api_keys(path: str) -> str:
    """Comma-separated keys from a file (lines or commas) or, with no file, from SPECMESH_API_KEY."""
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise UsageError(f"--api-key-file {path}: {e.strerror or e}") from None
        keys = [k.strip() for line in text.splitlines() for k in line.split(",") if k.strip()]
        if not keys:
            raise UsageError(f"--api-key-file {path}: no key in it")
        return ",".join(keys)
    return os.environ.get(API_KEY_ENV, "")


def _split(flags: list[str]) -> list[str]:
    """--verify-arg values: each may hold several words (`--verify-arg "--batch-wait-ms 5"`)."""
    return [word for flag in flags for word in shlex.split(flag)]


def _check_draft_kind(path: str, algorithm_name: str) -> None:
    """EAGLE heads are no standalone model: refuse them by name rather than fail in the draft service."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return  # the launcher's preflight reports the path
    archs = " ".join(config.get("architectures") or [])
    if "eagle" in archs.lower() or "mtp" in archs.lower():
        raise UsageError(
            f"{path} is a draft head ({archs}) for SGLang's {algorithm_name.upper()}; specmesh drafts with a "
            "standalone causal LM that shares the target's tokenizer"
        )


def _kv_budget_mb(fraction: float, plan, target: str) -> int:
    """SGLang's --mem-fraction-static (weights + KV of the whole GPU) as the verify service's KV budget: the
    fraction of the device's memory, less the target's weights."""
    if not 0 < fraction < 1:
        raise UsageError(f"--mem-fraction-static {fraction}: must be in (0, 1)")
    device = plan.device or ""
    import torch

    if not device.startswith("cuda") and not (not device and torch.cuda.is_available()):
        raise UsageError(
            "--mem-fraction-static sizes GPU memory; on the CPU set the KV budget with "
            "--verify-arg=--kv-cache-budget-mb=N"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    total = torch.cuda.get_device_properties(index).total_memory
    weights = sum(f.stat().st_size for f in Path(target).glob("*.safetensors")) or sum(
        f.stat().st_size for f in Path(target).glob("*.bin")
    )
    budget = int((fraction * total - weights) / 2**20)
    if budget <= 0:
        raise UsageError(
            f"--mem-fraction-static {fraction}: {fraction * total / 2**30:.1f} GiB does not even hold the target's "
            f"weights ({weights / 2**30:.1f} GiB)"
        )
    return budget


def plan_from_args(a: argparse.Namespace):
    """The launcher's StackPlan from `serve`'s flags, SGLang's spellings mapped, the unsupported refused."""
    from specmesh.stack import StackPlan

    if a.api_key is not None:
        raise UsageError(
            f"--api-key on the command line is visible to every user of this machine (ps): put the keys in a file "
            f"(--api-key-file FILE) or in the {API_KEY_ENV} environment variable"
        )
    if not a.model_path:
        raise UsageError("--model-path DIR (the target model) is required")
    algorithm_name = a.speculative_algorithm or ("standalone" if a.draft_model_path else "")
    if algorithm_name in REFUSED_ALGORITHMS:
        raise UsageError(f"--speculative-algorithm {algorithm_name.upper()}: {REFUSED_ALGORITHMS[algorithm_name]}")
    if algorithm_name and algorithm_name not in ALGORITHMS:
        raise UsageError(
            f"--speculative-algorithm {algorithm_name}: not one of {', '.join(sorted(ALGORITHMS))} (case-insensitive)"
        )
    algorithm = ALGORITHMS.get(algorithm_name, "")
    if not algorithm:
        raise UsageError("a draft is needed: --speculative-draft-model-path DIR, or --speculative-algorithm ngram")
    if algorithm == "standalone" and a.draft_model_path:
        _check_draft_kind(a.draft_model_path, algorithm_name)
    if a.tp_size != 1:
        raise UsageError(
            f"--tp-size {a.tp_size}: specmesh runs each model on one device; scale out with --verify-replicas N"
        )
    if a.speculative_eagle_topk not in (None, 1):
        raise UsageError(f"--speculative-eagle-topk {a.speculative_eagle_topk}: specmesh drafts a chain (topk 1)")
    k = a.speculative_num_steps
    if a.speculative_num_draft_tokens is not None:
        from_tokens = a.speculative_num_draft_tokens - 1
        if k is not None and k != from_tokens:
            raise UsageError(
                f"--speculative-num-draft-tokens {a.speculative_num_draft_tokens} contradicts --speculative-num-steps "
                f"{k}: a chain of K steps verifies K + 1 tokens"
            )
        k = from_tokens
    if k is not None and not 0 <= k <= 32:
        raise UsageError(f"--speculative-num-steps {k}: must be in [0, 32]")
    verify_replicas = a.verify_replicas or a.dp_size or 1
    draft_replicas = a.draft_replicas or a.dp_size or 1
    verify_args, draft_args, gateway_args = _split(a.verify_args), _split(a.draft_args), _split(a.gateway_args)
    if a.log_level:
        for args in (verify_args, draft_args, gateway_args):
            args[:0] = ["--log-level", a.log_level]
    if a.context_length is not None:
        verify_args[:0] = ["--max-model-len", str(a.context_length)]
    if a.random_seed is not None:
        verify_args[:0] = ["--seed", str(a.random_seed)]
    if a.max_running_requests is not None:
        gateway_args[:0] = ["--max-concurrency", str(a.max_running_requests)]
    if a.speculative_disable_by_batch_size is not None:
        if a.speculative_disable_by_batch_size < 0:
            raise UsageError(f"--speculative-disable-by-batch-size {a.speculative_disable_by_batch_size}: must be >= 0")
        gateway_args[:0] = ["--speculative-disable-by-batch-size", str(a.speculative_disable_by_batch_size)]
    plan = StackPlan(
        target=a.model_path,
        draft=a.draft_model_path if algorithm == "standalone" else None,
        algorithm=algorithm,
        num_steps=k,
        host=a.host,
        port=a.port,
        grpc_port=a.grpc_port,
        verify_replicas=verify_replicas,
        draft_replicas=draft_replicas,
        device=a.device,
        draft_device=a.draft_device,
        model_name=a.model_name,
        api_keys=read_api_keys(a.api_key_file),
        verify_args=verify_args,
        draft_args=draft_args,
        gateway_args=gateway_args,
        verify_threads=a.verify_threads,
        draft_threads=a.draft_threads,
        first_request=a.first_request,
        smoke=a.smoke,
        startup_timeout_s=a.startup_timeout_s,
    )
    if algorithm == "ngram" and a.draft_model_path:
        raise UsageError("--speculative-algorithm ngram drafts from the prompt: give no draft model")
    if a.mem_fraction_static is not None:
        plan.verify_args[:0] = ["--kv-cache-budget-mb", str(_kv_budget_mb(a.mem_fraction_static, plan, a.model_path))]
    return plan


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "serve":
            from specmesh.stack import serve

            return serve(plan_from_args(args))
        from specmesh.profile import run_profile

        return run_profile(args, read_api_keys(args.api_key_file).split(",")[0])
    except UsageError as e:
        print(f"specmesh {args.command}: error: {e}", file=sys.stderr)
        return 2
