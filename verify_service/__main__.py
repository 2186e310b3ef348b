"""python -m verify_service --model-path DIR [--port N ...]: the target model behind a batching scheduler.

Every flag can also be set by an environment variable SPECMESH_VERIFY_<FLAG> (e.g. SPECMESH_VERIFY_PORT).
"""

from __future__ import annotations

from specmesh.config import EnvArgumentParser, add_process_flags, split_process_flags
from specmesh.rejection import MAX_SPEC_LEN
from specmesh.serving import run_service
from verify_service.engine import VerifyConfig
from verify_service.runner import MIN_AUTO_SLOT_TOKENS, RUNNERS
from verify_service.server import build_server


def parse_args(argv=None) -> tuple[VerifyConfig, dict]:
    ap = EnvArgumentParser(prog="python -m verify_service", description=__doc__, env_prefix="SPECMESH_VERIFY_")
    d = VerifyConfig()
    ap.flag("--model-path", required=True, help="local HF checkpoint directory of the target model")
    ap.flag("--host", default=d.host, help="address to listen on (0.0.0.0 for all interfaces)")
    ap.flag("--port", type=int, default=d.port, help="gRPC port (0 = any free port, printed at start)")
    ap.flag("--device", default=None, help="torch device; default cuda when available, else cpu")
    _add_memory_flags(ap, d)
    _add_batching_flags(ap, d)
    ap.flag("--seed", type=int, default=None, help="seed of the shared random stream (unseeded requests)")
    ap.flag(
        "--grace-period-s",
        type=float,
        default=d.grace_period_s,
        help="on SIGTERM, in-flight sessions get this long to finish",
    )
    add_process_flags(ap)
    args = vars(ap.parse_args(argv))
    extra = split_process_flags(args)
    try:
        return VerifyConfig(**args), extra
    except ValueError as e:
        ap.error(str(e))


def _add_memory_flags(ap: EnvArgumentParser, d: VerifyConfig) -> None:
    """The runtime, its KV cache and the sessions it holds."""
    ap.flag(
        "--max-sessions",
        type=int,
        default=d.max_sessions,
        help="concurrent session streams and generate calls; more get RESOURCE_EXHAUSTED",
    )
    ap.flag(
        "--kv-cache-budget-mb",
        type=float,
        default=d.kv_cache_budget_mb,
        help="KV cache memory for all sessions (the batched runner allocates it as slots at start); idle "
        "sessions are evicted LRU when a new one does not fit",
    )
    ap.flag(
        "--runner",
        default=d.runner,
        choices=list(RUNNERS),
        help="target runtime: batched = one ragged forward over a KV slot pool (Llama family), hf = the "
        "stock HF forward (any causal LM), auto = batched when the model and budget allow it",
    )
    ap.flag(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="most tokens per session (prompt + max_tokens) = a KV slot's length; 0 = the model's context, "
        f"capped so that the budget holds --max-sessions slots (auto falls back to hf when that leaves "
        f"fewer than {MIN_AUTO_SLOT_TOKENS} tokens)",
    )
    ap.flag("--session-ttl-s", type=float, default=d.session_ttl_s, help="idle sessions are evicted after this")
    _add_bound_flags(ap, d)


def _add_bound_flags(ap: EnvArgumentParser, d: VerifyConfig) -> None:
    """Hard bounds against clients that open sessions and never stream, or stream and go silent."""
    ap.flag(
        "--max-cached-sessions",
        type=int,
        default=d.max_cached_sessions,
        help="sessions held, idle cached ones included (LRU-evicted beyond it, RESOURCE_EXHAUSTED when all are "
        "in use); 0 = the KV slot count (hf runner: 4 x --max-sessions)",
    )
    ap.flag(
        "--attach-timeout-s",
        type=float,
        default=d.attach_timeout_s,
        help="an opened session that no Verify stream attaches to within this is released (0 = never)",
    )
    ap.flag(
        "--stream-idle-timeout-s",
        type=float,
        default=d.stream_idle_timeout_s,
        help="a Verify stream whose client sends nothing for this is closed with DEADLINE_EXCEEDED and its "
        "session released (0 = never); unlike --draft-deadline-ms, which only takes target-only steps",
    )


def _add_batching_flags(ap: EnvArgumentParser, d: VerifyConfig) -> None:
    """What one scheduler tick's forward holds, and how long it waits for it."""
    ap.flag(
        "--max-batch-size",
        type=int,
        default=d.max_batch_size,
        help="most draft blocks (sessions) verified in one batched target forward",
    )
    ap.flag(
        "--max-batch-tokens",
        type=int,
        default=d.max_batch_tokens,
        help="positions one scheduler tick's forward may compute: its draft blocks first, then prefill chunks "
        "of sessions being opened (batched runner)",
    )
    ap.flag(
        "--draft-deadline-ms",
        type=float,
        default=d.draft_deadline_ms,
        help="past this wait for a draft block, take a target-only step instead (0 = never)",
    )
    ap.flag(
        "--batch-wait-ms",
        type=float,
        default=d.batch_wait_ms,
        help="a batch waits up to this long for the other active sessions' blocks (0 = start at once) ...",
    )
    ap.flag(
        "--batch-wait-fraction",
        type=float,
        default=d.batch_wait_fraction,
        help="... or up to this fraction of a recent batch's time, if longer: under speculation the other "
        "sessions' blocks come only after their drafts, and one full batch costs less than two halves",
    )
    ap.flag(
        "--prefill-chunk-tokens",
        type=int,
        default=d.prefill_chunk_tokens,
        help="most prompt tokens one session prefills per forward, so a long prompt does not stall the "
        "others' blocks (0 = no limit of its own: the tick's budget, or the whole prompt with hf)",
    )
    ap.flag(
        "--max-spec-len",
        type=int,
        default=d.max_spec_len,
        help=f"most draft tokens one block may carry (<= {MAX_SPEC_LEN})",
    )
    ap.flag(
        "--sampler-backend",
        default=d.sampler_backend,
        choices=["auto", "torch", "triton"],
        help="rejection sampler: triton on CUDA, torch on CPU when auto",
    )


def main(argv=None) -> None:
    config, process = parse_args(argv)
    run_service("verify_service", build_server, config, process)


if __name__ == "__main__":
    main()
