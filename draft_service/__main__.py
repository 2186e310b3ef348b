"""python -m draft_service --model-path DIR --verify-address HOST:PORT [--port N ...]: the draft model and
the speculation loop. Every flag can also be set by an environment variable SPECMESH_DRAFT_<FLAG>.
"""

from __future__ import annotations

from draft_service.engine import ALGORITHMS, RUNNERS, DraftConfig
from draft_service.server import build_server
from specmesh.config import EnvArgumentParser, add_config_flags, add_process_flags, add_server_flags, parse_config
from specmesh.serving import run_service

# The flags of DraftConfig's fields past the model, server and verifier: each takes its field's default and type.
FLAG_HELP = {
    "speculative_algorithm": "standalone: a draft model; ngram: prompt lookup, no model",
    "speculative_num_steps": "most draft tokens per block (K); adaptive K stays within it",
    "adaptive": "choose K per session for the verifier's goodput, from live acceptance, timings and the "
    "verifier's load (down to 0)",
    "pipeline": "keep drafting the next block while one is being verified",
    "draft_topk": "sampled drafts: the support of the sparse draft distribution sent with each token",
    "draft_runner": "batched: one forward advances every drafting session (Llama family); static: one session per "
    "forward, preallocated cache; hf: the stock HF forward; auto: batched where the model allows it",
    "max_model_len": "longest sequence a session's draft KV slot holds (0 = the model's max_position_embeddings)",
    "max_sessions": "concurrent generations; more get RESOURCE_EXHAUSTED",
    "max_cached_sessions": "per-session draft KV caches kept for later turns (LRU)",
    "verify_timeout_s": "timeout of each call to the verifier",
    "grace_period_s": "on SIGTERM, in-flight generations get this long to finish",
}
FLAG_OPTIONS = {
    "speculative_algorithm": {"type": str.lower, "choices": list(ALGORITHMS)},
    "draft_runner": {"choices": list(RUNNERS)},
}


def parse_args(argv=None) -> tuple[DraftConfig, dict]:
    ap = EnvArgumentParser(prog="python -m draft_service", description=__doc__, env_prefix="SPECMESH_DRAFT_")
    d = DraftConfig(model_path="-")
    ap.flag("--model-path", default="", help="local HF checkpoint directory of the draft model (standalone)")
    add_server_flags(ap, d.host, d.port)
    ap.flag("--verify-address", default="", help="default verify replica host:port (a request may name another)")
    add_config_flags(ap, d, FLAG_HELP, FLAG_OPTIONS)
    add_process_flags(ap, metrics_port=9465)
    return parse_config(ap, DraftConfig, argv)


def main(argv=None) -> None:
    config, process = parse_args(argv)
    run_service("draft_service", build_server, config, process)


if __name__ == "__main__":
    main()
