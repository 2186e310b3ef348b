"""python -m draft_service --model-path DIR --verify-address HOST:PORT [--port N ...]: the draft model and
the speculation loop. Every flag can also be set by an environment variable SPECMESH_DRAFT_<FLAG>.
"""

from __future__ import annotations

from draft_service.engine import ALGORITHMS, RUNNERS, DraftConfig
from draft_service.server import build_server
from specmesh.config import EnvArgumentParser, add_process_flags, split_process_flags
from specmesh.serving import run_service


def parse_args(argv=None) -> tuple[DraftConfig, dict]:
    ap = EnvArgumentParser(prog="python -m draft_service", description=__doc__, env_prefix="SPECMESH_DRAFT_")
    d = DraftConfig(model_path="-")
    ap.flag("--model-path", default="", help="local HF checkpoint directory of the draft model (standalone)")
    ap.flag("--host", default=d.host, help="address to listen on (0.0.0.0 for all interfaces)")
    ap.flag("--port", type=int, default=d.port, help="gRPC port (0 = any free port, printed at start)")
    ap.flag("--device", default=None, help="torch device; default cuda when available, else cpu")
    ap.flag("--verify-address", default="", help="default verify replica host:port (a request may name another)")
    ap.flag(
        "--speculative-algorithm",
        default=d.speculative_algorithm,
        type=str.lower,
        choices=list(ALGORITHMS),
        help="standalone: a draft model; ngram: prompt lookup, no model",
    )
    ap.flag(
        "--speculative-num-steps",
        type=int,
        default=d.speculative_num_steps,
        help="most draft tokens per block (K); adaptive K stays within it",
    )
    ap.flag(
        "--adaptive",
        type=bool,
        default=d.adaptive,
        help="choose K per session for the verifier's goodput, from live acceptance, timings and the "
        "verifier's load (down to 0)",
    )
    ap.flag(
        "--pipeline", type=bool, default=d.pipeline, help="keep drafting the next block while one is being verified"
    )
    ap.flag(
        "--draft-topk",
        type=int,
        default=d.draft_topk,
        help="sampled drafts: the support of the sparse draft distribution sent with each token",
    )
    ap.flag(
        "--draft-runner",
        default=d.draft_runner,
        choices=list(RUNNERS),
        help="batched: one forward advances every drafting session (Llama family); static: one session per "
        "forward, preallocated cache; hf: the stock HF forward; auto: batched where the model allows it",
    )
    ap.flag(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest sequence a session's draft KV slot holds (0 = the model's max_position_embeddings)",
    )
    ap.flag(
        "--max-sessions", type=int, default=d.max_sessions, help="concurrent generations; more get RESOURCE_EXHAUSTED"
    )
    ap.flag(
        "--max-cached-sessions",
        type=int,
        default=d.max_cached_sessions,
        help="per-session draft KV caches kept for later turns (LRU)",
    )
    ap.flag("--verify-timeout-s", type=float, default=d.verify_timeout_s, help="timeout of each call to the verifier")
    ap.flag(
        "--grace-period-s",
        type=float,
        default=d.grace_period_s,
        help="on SIGTERM, in-flight generations get this long to finish",
    )
    add_process_flags(ap, metrics_port=9465)
    args = vars(ap.parse_args(argv))
    extra = split_process_flags(args)
    try:
        return DraftConfig(**args), extra
    except ValueError as e:
        ap.error(str(e))


def main(argv=None) -> None:
    config, process = parse_args(argv)
    run_service("draft_service", build_server, config, process)


if __name__ == "__main__":
    main()
