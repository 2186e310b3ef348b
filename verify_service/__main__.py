"""python -m verify_service --model-path DIR [--port N ...]: the target model behind a batching scheduler.

Every flag can also be set by an environment variable SPECMESH_VERIFY_<FLAG> (e.g. SPECMESH_VERIFY_PORT).
"""

from __future__ import annotations

from specmesh.config import EnvArgumentParser, add_config_flags, add_process_flags, add_server_flags, parse_config
from specmesh.rejection import MAX_SPEC_LEN
from specmesh.runtime.attention import ATTENTION_BACKENDS
from specmesh.security import add_service_flags
from specmesh.serving import run_service
from verify_service.engine import VerifyConfig
from verify_service.runner import MIN_AUTO_SLOT_TOKENS, RUNNERS
from verify_service.server import build_server

# The flags of VerifyConfig's fields past the model and server, in --help's order: each takes its field's
# default and type.
FLAG_HELP = {
    # The runtime, its KV cache and the sessions it holds.
    "max_sessions": "concurrent session streams and generate calls; more get RESOURCE_EXHAUSTED",
    "kv_cache_budget_mb": "KV cache memory for all sessions (the batched runner allocates it as slots at start); "
    "idle sessions are evicted LRU when a new one does not fit",
    "kv_cache_prefault": "write the batched runner's whole KV pool at start, so the process's memory is resident "
    "from the start and stays flat under load (--no-kv-cache-prefault: pages are taken as slots first fill them)",
    "attention_backend": "SDPA kernels the runtime may use: auto = all but cuDNN on CUDA (cuDNN builds a plan per new "
    "sequence length, which a decode meets every forward), torch's own choice elsewhere; default = torch's own "
    "choice; no-cudnn; math (reference, slow)",
    "runner": "target runtime: batched = one ragged forward over a KV slot pool (Llama family), hf = the stock HF "
    "forward (any causal LM), auto = batched when the model and budget allow it",
    "max_model_len": "most tokens per session (prompt + max_tokens) = a KV slot's length; 0 = the model's context, "
    "capped so that the budget holds --max-sessions slots (auto falls back to hf when that leaves fewer than "
    f"{MIN_AUTO_SLOT_TOKENS} tokens)",
    "session_ttl_s": "idle sessions are evicted after this",
    # Hard bounds against clients that open sessions and never stream, or stream and go silent.
    "max_cached_sessions": "sessions held, idle cached ones included (LRU-evicted beyond it, RESOURCE_EXHAUSTED "
    "when all are in use); 0 = the KV slot count (hf runner: 4 x --max-sessions)",
    "attach_timeout_s": "an opened session that no Verify stream attaches to within this is released (0 = never)",
    "stream_idle_timeout_s": "a Verify stream whose client sends nothing for this is closed with DEADLINE_EXCEEDED "
    "and its session released (0 = never); unlike --draft-deadline-ms, which only takes target-only steps",
    # What one scheduler tick's forward holds, and how long it waits for it.
    "max_batch_size": "most draft blocks (sessions) verified in one batched target forward",
    "max_batch_tokens": "positions one scheduler tick's forward may compute: its draft blocks first, then prefill "
    "chunks of sessions being opened (batched runner)",
    "draft_deadline_ms": "past this wait for a draft block, take a target-only step instead (0 = never)",
    "batch_wait_ms": "a batch waits up to this long for the other active sessions' blocks (0 = start at once) ...",
    "batch_wait_fraction": "... or up to this fraction of a recent batch's time, if longer: under speculation the "
    "other sessions' blocks come only after their drafts, and one full batch costs less than two halves",
    "prefill_chunk_tokens": "most prompt tokens one session prefills per forward, so a long prompt does not stall "
    "the others' blocks (0 = no limit of its own: the tick's budget, or the whole prompt with hf)",
    "max_spec_len": f"most draft tokens one block may carry (<= {MAX_SPEC_LEN})",
    "sampler_backend": "rejection sampler: triton on CUDA, torch on CPU when auto",
    "seed": "seed of the shared random stream (unseeded requests)",
    "grace_period_s": "on SIGTERM, in-flight sessions get this long to finish",
}
FLAG_OPTIONS = {
    "runner": {"choices": list(RUNNERS)},
    "attention_backend": {"choices": list(ATTENTION_BACKENDS)},
    "sampler_backend": {"choices": ["auto", "torch", "triton"]},
    "seed": {"type": int},  # its default, None, has no type to parse with
}


def parse_args(argv=None) -> tuple[VerifyConfig, dict]:
    ap = EnvArgumentParser(prog="python -m verify_service", description=__doc__, env_prefix="SPECMESH_VERIFY_")
    d = VerifyConfig()
    ap.flag("--model-path", required=True, help="local HF checkpoint directory of the target model")
    add_server_flags(ap, d.host, d.port)
    add_config_flags(ap, d, FLAG_HELP, FLAG_OPTIONS)
    add_process_flags(ap)
    add_service_flags(ap)
    return parse_config(ap, VerifyConfig, argv)


def main(argv=None) -> None:
    run_service("verify_service", build_server, *parse_args(argv))


if __name__ == "__main__":
    main()
