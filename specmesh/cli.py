"""`specmesh`: the command line (also `python -m specmesh`).

    specmesh serve --model-path T --speculative-draft-model-path D [--port 8000] [--grpc-port 50070] ...
    specmesh serve --model-path T --speculative-algorithm ngram|suffix ...
    specmesh profile --url http://127.0.0.1:8000 [--duration 60] [--concurrency 1,4,16] [--out DIR]

`serve` starts the verify service(s), the draft service(s) and the gateway as separate processes
(specmesh.stack), `profile` drives a workload through a running stack and writes an optimization report
(specmesh.profile). SGLang's launcher spellings are accepted where they mean the same thing (`--model`,
`--draft-model`, `--speculative-algorithm EAGLE|STANDALONE|NGRAM|SUFFIX`, `--tp 1`, `--dp N`,
`--served-model-name`, `--context-length`, ...); those that specmesh cannot honour are refused with the
reason rather than ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from specmesh.config import (
    KV_CACHE_DTYPES,
    EnvArgumentParser,
    GatewayListen,
    Logging,
    add_config_flags,
    option,
    to_argv,
)
from specmesh.errors import ConfigError
from specmesh.placement import add_thread_flags
from specmesh.stack import StackPlan, StackSecurity, serve

API_KEY_ENV = "SPECMESH_API_KEY"

# SGLang's speculative algorithms (and vLLM's suffix method) and what each means here.
ALGORITHMS = {
    "standalone": "standalone",  # a separate, smaller draft model: what the draft service runs
    "eagle": "standalone",  # SGLang's EAGLE needs a draft; a full draft model stands in for its head
    "eagle3": "standalone",
    "ngram": "ngram",
    "suffix": "suffix",  # vLLM's: suffix trees over the prompt, the output and recent generations
}
REFUSED_ALGORITHMS = {
    "nextn": "multi-token-prediction heads (NEXTN) live inside the target; specmesh drafts with a separate "
    "model (--speculative-draft-model-path) or --speculative-algorithm ngram",
    "lookahead": "use --speculative-algorithm ngram (prompt lookup)",
}
ROLES = {"verify": "verify_service", "draft": "draft_service", "gateway": "gateway"}  # role -> its module
# The gateway's --per-request-spec-decode-metrics levels (gateway.config's, which the core may not import).
SPEC_DECODE_METRICS_LEVELS = ("none", "summary", "detailed")


class UsageError(Exception):
    """A flag combination specmesh refuses: shown as one line, exit code 2."""


# --- `specmesh serve`'s flags, a dataclass per --help group ----------------------------------------------
@dataclass(frozen=True)
class ServeModels:
    """The models and speculation, in SGLang's launcher's spellings too."""

    model_path: str | None = option(
        None, "target checkpoint directory (local HF)", type=str, aliases=("--model", "--target-model")
    )
    draft_model_path: str | None = option(
        None,
        "draft checkpoint directory (same tokenizer as the target)",
        type=str,
        name="--speculative-draft-model-path",
        aliases=("--speculative-draft-model", "--draft-model-path", "--draft-model"),
    )
    speculative_algorithm: str | None = option(
        None,
        "standalone (a draft model; SGLang's EAGLE, EAGLE3 and STANDALONE mean this here), ngram (prompt "
        "lookup) or suffix (vLLM's suffix decoding: suffix trees over the prompt, the output and recent "
        "generations), the last two without a draft model; default: standalone when a draft model is given",
        type=str.lower,
    )
    speculative_num_steps: int | None = option(None, "most draft tokens per block, K (draft's default: 4)", type=int)
    speculative_num_draft_tokens: int | None = option(
        None, "SGLang's chain spelling of K + 1 (draft tokens including the verified root)", type=int
    )
    speculative_disable_by_batch_size: int | None = option(
        None,
        "vLLM: new requests decode target-only while more than this many run per verify replica (0 = never; "
        "default: by device, see specmesh.placement)",
        type=int,
    )
    speculative_eagle_topk: int | None = option(None, "SGLang's tree width: only 1 (a chain)", type=int)
    per_request_spec_decode_metrics: str | None = option(
        None,
        "vLLM: metrics.speculative_decoding in every answer: none, summary (the gateway's default) or detailed",
        type=str,
        choices=SPEC_DECODE_METRICS_LEVELS,
    )
    model_name: str = option("", "the model id clients send", name="--served-model-name", aliases=("--model-name",))


@dataclass(frozen=True)
class ServeNetwork(GatewayListen):
    """The gateway's addresses (its own flags) and the keys clients must send."""

    api_key_file: str = option(
        "", f"file with the API keys clients must send (one per line or comma-separated); or set {API_KEY_ENV}"
    )


@dataclass(frozen=True)
class ServePlacement:
    """How many processes of each service, and on what device."""

    verify_replicas: int | None = option(None, "verify service processes (default 1)", type=int)
    draft_replicas: int | None = option(None, "draft service processes (default 1)", type=int)
    dp_size: int | None = option(None, "SGLang: replicas of both", type=int, aliases=("--dp",))
    tp_size: int = option(1, "SGLang: tensor parallelism (only 1)", aliases=("--tp",))
    device: str | None = option(None, "torch device of the models (default: cuda when available)", type=str)
    draft_device: str | None = option(None, "torch device of the draft, if not --device", type=str)
    dtype: str = option(
        "auto",
        "vLLM's --dtype for both models: auto (bfloat16 on CUDA, float32 on a CPU), float32, bfloat16, float16",
        choices=("auto", "float32", "float", "bfloat16", "float16", "half"),
    )
    kv_cache_dtype: str = option(
        "auto",
        "vLLM's and SGLang's --kv-cache-dtype for the target's KV (the verify service's): auto = the model's dtype; "
        "bfloat16 (bf16) halves a float32 model's KV on a CPU (see python -m verify_service --help)",
        choices=tuple(KV_CACHE_DTYPES),
    )


@dataclass(frozen=True)
class ServeSettings(Logging):
    """Every service's logging, and SGLang's names of service settings."""

    mem_fraction_static: float | None = option(
        None,
        "SGLang: GPU memory fraction for weights + KV cache; here the verify service's KV budget (GPU only)",
        type=float,
    )
    context_length: int | None = option(None, "SGLang: the verify service's --max-model-len", type=int)
    max_running_requests: int | None = option(None, "SGLang: the gateway's --max-concurrency", type=int)
    random_seed: int | None = option(None, "SGLang: the verify service's --seed", type=int)
    cuda_graph_max_bs: int | None = option(
        None,
        "SGLang: largest batch whose decode step replays a CUDA graph, in both model services (default 32; CUDA)",
        type=int,
    )
    disable_cuda_graph: bool = option(False, "SGLang: no CUDA graphs in either model service")


@dataclass(frozen=True)
class ServeLauncher:
    """The launcher's own behaviour."""

    first_request: bool = option(True, "send one request once up and show its answer")
    smoke: bool = option(False, "stop again after the first answer (CI)")
    startup_timeout_s: float = option(600.0, "longest a service may take to start")


# --- `specmesh profile`'s flags ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ProfileFlags:
    url: str = option("http://127.0.0.1:8000", "the gateway's REST address")
    duration: float = option(60.0, "seconds of workload in all (split over the concurrencies)")
    concurrency: str = option("1,4,16", "comma-separated numbers of concurrent streams")
    prompts: str = option("", "prompts file: one per line, or JSONL with a 'prompt' field")
    out: str = option("profile-report", "directory for report.md, report.html and the plots")
    max_tokens: int = option(64, "tokens per request")
    model: str = option("", "model id to send (default: the gateway's first model)")
    baseline: bool = option(True, "also measure target-only decoding (num_speculative_tokens 0) for the speedup")
    api_key_file: str = option("", f"file with an API key to send; or set {API_KEY_ENV}")


def _repeatable(ap, name: str, metavar: str, help: str, dest: str | None = None) -> None:
    """A flag given any number of times, collected in a list."""
    ap.add_argument(name, action="append", default=[], metavar=metavar, dest=dest, help=help)


SERVE_GROUPS = (
    ("models", ServeModels),
    ("network", ServeNetwork),
    ("security", StackSecurity),
    ("placement", ServePlacement),
    ("service settings", ServeSettings),
    ("launcher", ServeLauncher),
)


def _serve_flags(ap: EnvArgumentParser) -> None:
    groups = {}
    for title, flags in SERVE_GROUPS:
        groups[title] = ap.add_argument_group(title)
        add_config_flags(ap, flags, groups[title])
    groups["network"].add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: see plan_from_args
    add_thread_flags(groups["placement"])
    for role, module in ROLES.items():
        help = f"a flag for the {role} service, passed through (repeatable): --{role}-arg=--flag=value "
        help += f"(`python -m {module} --help` lists them)"
        _repeatable(groups["service settings"], f"--{role}-arg", "FLAG", help, dest=f"{role}_args")


def _profile_flags(ap: EnvArgumentParser) -> None:
    add_config_flags(ap, ProfileFlags)
    help = "a service's /metrics (verify=URL, draft=URL, gateway=URL; repeatable); default: the stack's own record "
    _repeatable(ap, "--metrics-url", "ROLE=URL", help + "when `specmesh serve` runs it on this machine")


def _widen_flags(ap: EnvArgumentParser) -> None:
    from specmesh.widen import add_flags

    add_flags(ap)


COMMANDS = {  # name: (help, description, its flags)
    "serve": (
        "start verify, draft and gateway as separate processes and serve until Ctrl-C",
        "Start the verify service(s), the draft service(s) and the gateway as separate processes, wait until all "
        "are healthy, print the endpoints, serve until Ctrl-C / SIGTERM (which stops them all). SGLang's launcher "
        "spellings are accepted where they mean the same thing.",
        _serve_flags,
    ),
    "profile": (
        "drive a workload through a running stack and write an optimization report",
        "Drive a workload through a running stack's REST API at each concurrency, read the services' /metrics and "
        "every response's speculation stats, and write report.md and report.html (with PNG plots) ending with "
        "ranked recommendations.",
        _profile_flags,
    ),
    "widen": (
        "write a function-preserving widening of a Llama checkpoint (a real-size model from a small one)",
        "Write a Llama checkpoint of a larger shape (hidden size, heads, KV heads, head_dim, MLP, layers; or a real "
        "model's, --preset) whose logits equal the source's: the new parts contribute exactly nothing, while every "
        "forward does the larger shape's work. For measuring a real-size pair where no model hub is reachable.",
        _widen_flags,
    ),
}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="specmesh", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=EnvArgumentParser)
    for name, (help, description, add_flags) in COMMANDS.items():
        # env_prefix None: serve's flags reach the services, which read their own SPECMESH_<SERVICE>_* variables
        add_flags(sub.add_parser(name, help=help, description=description, allow_abbrev=False, env_prefix=None))
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


def plan_from_args(a: argparse.Namespace) -> StackPlan:
    """The launcher's StackPlan from `serve`'s flags, SGLang's spellings mapped, the unsupported refused."""
    if a.api_key is not None:
        raise UsageError(
            f"--api-key on the command line is visible to every user of this machine (ps): put the keys in a file "
            f"(--api-key-file FILE) or in the {API_KEY_ENV} environment variable"
        )
    if not a.model_path:
        raise UsageError("--model-path DIR (the target model) is required")
    algorithm = _algorithm(a)
    if a.tp_size != 1:
        raise UsageError(
            f"--tp-size {a.tp_size}: specmesh runs each model on one device; scale out with --verify-replicas N"
        )
    if a.speculative_eagle_topk not in (None, 1):
        raise UsageError(f"--speculative-eagle-topk {a.speculative_eagle_topk}: specmesh drafts a chain (topk 1)")
    if a.cuda_graph_max_bs is not None and a.cuda_graph_max_bs < 0:
        raise UsageError(f"--cuda-graph-max-bs {a.cuda_graph_max_bs}: must be >= 0")
    if a.speculative_disable_by_batch_size is not None and a.speculative_disable_by_batch_size < 0:
        raise UsageError(f"--speculative-disable-by-batch-size {a.speculative_disable_by_batch_size}: must be >= 0")
    decided = dict(
        target=a.model_path,
        draft=a.draft_model_path if algorithm == "standalone" else None,
        algorithm=algorithm,
        num_steps=_num_steps(a),
        verify_replicas=a.verify_replicas or a.dp_size or 1,
        draft_replicas=a.draft_replicas or a.dp_size or 1,
        api_keys=read_api_keys(a.api_key_file),
        security=StackSecurity(**_same_names(a, StackSecurity)),
    )
    plan = StackPlan(**{**_same_names(a, StackPlan), **decided, **_service_args(a)})
    if a.mem_fraction_static is not None:
        budget = {"kv_cache_budget_mb": _kv_budget_mb(a.mem_fraction_static, plan, a.model_path)}
        plan.verify_args[:0] = to_argv(budget)
    return plan


def _same_names(a: argparse.Namespace, config_type) -> dict:
    """The flags of `a` that are fields of `config_type` by the same name (the launcher's plan takes those as
    given: --host, --port, --device, --smoke, ...)."""
    return {f.name: getattr(a, f.name) for f in dataclasses.fields(config_type) if hasattr(a, f.name)}


def _algorithm(a: argparse.Namespace) -> str:
    """The draft service's algorithm for SGLang's name (or none: a draft model means standalone)."""
    name = a.speculative_algorithm or ("standalone" if a.draft_model_path else "")
    if name in REFUSED_ALGORITHMS:
        raise UsageError(f"--speculative-algorithm {name.upper()}: {REFUSED_ALGORITHMS[name]}")
    if name and name not in ALGORITHMS:
        raise UsageError(
            f"--speculative-algorithm {name}: not one of {', '.join(sorted(ALGORITHMS))} (case-insensitive)"
        )
    algorithm = ALGORITHMS.get(name, "")
    if not algorithm:
        raise UsageError(
            "a draft is needed: --speculative-draft-model-path DIR, or --speculative-algorithm ngram or suffix"
        )
    if algorithm == "standalone" and a.draft_model_path:
        _check_draft_kind(a.draft_model_path, name)
    if algorithm == "ngram" and a.draft_model_path:
        raise UsageError("--speculative-algorithm ngram drafts from the prompt: give no draft model")
    if algorithm == "suffix" and a.draft_model_path:
        raise UsageError("--speculative-algorithm suffix drafts from suffix trees of the text: give no draft model")
    return algorithm


def _num_steps(a: argparse.Namespace) -> int | None:
    """K, from --speculative-num-steps or SGLang's --speculative-num-draft-tokens (K + 1)."""
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
    return k


def _service_args(a: argparse.Namespace) -> dict[str, list[str]]:
    """Each service's flags from `serve`'s: logging for all three, SGLang's service settings under the
    services' own names, then what --<role>-arg passes through (last, so it wins)."""
    log = to_argv(Logging(a.log_level, a.log_format))
    verify = {"seed": a.random_seed, "max_model_len": a.context_length}
    gateway: dict[str, object] = {"max_concurrency": a.max_running_requests}
    gateway["speculative_disable_by_batch_size"] = a.speculative_disable_by_batch_size
    gateway["per_request_spec_decode_metrics"] = a.per_request_spec_decode_metrics
    return {
        "verify_args": log + to_argv(verify) + _split(a.verify_args),
        "draft_args": log + _split(a.draft_args),
        "gateway_args": log + to_argv(gateway) + _split(a.gateway_args),
    }


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "serve":
            return serve(plan_from_args(args))
        if args.command == "widen":
            from specmesh.widen import run

            try:
                return run(args)
            except ConfigError as e:
                raise UsageError(str(e)) from None
        from specmesh.profile import run_profile

        return run_profile(args, read_api_keys(args.api_key_file).split(",")[0])
    except UsageError as e:
        print(f"specmesh {args.command}: error: {e}", file=sys.stderr)
        return 2
