"""python -m draft_service --model-path DIR --verify-address HOST:PORT [--port N ...]: the draft model and
the speculation loop. Every flag can also be set by an environment variable SPECMESH_DRAFT_<FLAG>.
"""

from __future__ import annotations

import argparse
import os
import time

from draft_service.engine import ALGORITHMS, RUNNERS, DraftConfig
from draft_service.server import build_server
from specmesh.config import EnvArgumentParser, add_config_flags, add_process_flags, add_server_flags, parse_config
from specmesh.drafters import DraftBatcher
from specmesh.runtime.attention import ATTENTION_BACKENDS
from specmesh.security import add_service_flags
from specmesh.serving import run_service

DEBUG_DELAY_ENV = "SPECMESH_DRAFT_DEBUG_DRAFT_DELAY_MS"
DEBUG_SLOWDOWN_ENV = "SPECMESH_DRAFT_DEBUG_DRAFT_SLOWDOWN"

# The flags of DraftConfig's fields past the model, server and verifier: each takes its field's default and type.
FLAG_HELP = {
    "speculative_algorithm": "standalone: a draft model; ngram: prompt lookup, no model",
    "speculative_num_steps": "most draft tokens per block (K); adaptive K stays within it",
    "adaptive": "choose K per session for the verifier's goodput, from live acceptance, timings and the "
    "verifier's load (down to 0)",
    "goodput_guard": "adaptive K falls back to target-only while speculation measures fewer tokens per second "
    "than target-only steps (pooled over sessions; a few probe steps keep both sides measured)",
    "speculative_disable_by_batch_size": "adaptive K drafts nothing while the verifier's last batch held more "
    "sessions than this (0 = no limit; the gateway's flag of that name decides it for new requests)",
    "pipeline": "keep drafting the next block while one is being verified",
    "draft_topk": "sampled drafts: the support of the sparse draft distribution sent with each token",
    "attention_backend": "SDPA kernels the runtime may use: auto = all but cuDNN on CUDA (cuDNN builds a plan per new "
    "sequence length, which a decode meets every forward), torch's own choice elsewhere; default = torch's own "
    "choice; no-cudnn; math (reference, slow)",
    "draft_runner": "batched: one forward advances every drafting session (Llama family); static: one session per "
    "forward, preallocated cache; hf: the stock HF forward; auto: batched where the model allows it",
    "max_model_len": "longest sequence a session's draft KV slot holds (0 = the model's max_position_embeddings)",
    "max_sessions": "concurrent generations; more get RESOURCE_EXHAUSTED",
    "max_cached_sessions": "per-session draft KV caches kept for later turns (LRU)",
    "kv_cache_prefault": "write the batched runner's whole KV pool at start, so the process's memory is resident "
    "from the start and stays flat under load (--no-kv-cache-prefault: pages are taken as slots first fill them)",
    "verify_allow": "verify replicas a request's verify_address may name besides --verify-address: comma-separated "
    "host:port, the host an IP, a CIDR block (10.0.0.0/8), a DNS name (its addresses too) or a pattern "
    "(*.verify.svc.cluster.local), the port a number or *; any other address is refused (PERMISSION_DENIED)",
    "verify_timeout_s": "timeout of each call to the verifier",
    "grace_period_s": "on SIGTERM, in-flight generations get this long to finish",
    "online_distill": "distil the draft from the verifier's top-k on live traffic while serving, swapping new "
    "weights in between rounds and rolling back a version whose live acceptance is worse (see README)",
    "online_distill_dir": "save every weight version and its live acceptance here (empty = in memory only)",
    "online_distill_topk": "target tokens per position the verifier returns as feedback (1-20)",
    "online_distill_cpu_share": "the trainer's share of one core's time (it sleeps the rest)",
    "online_distill_buffer": "replay buffer size, in training windows of 64 tokens",
    "online_distill_lr": "the trainer's learning rate (AdamW)",
    "online_distill_kl_weight": "weight of the KL to the target's top-k in the loss; the rest is cross-entropy on "
    "the committed token (1 = pure KL)",
    "online_distill_steps_per_version": "training steps between two weight versions",
    "online_distill_rollback_window": "draft tokens a new version is judged on against its predecessor",
    "online_distill_rehearsal": "windows of the draft's original domain with the target's top-k (python -m "
    "specmesh.training.rehearsal), mixed into every training batch so the draft keeps that domain: auto = the draft "
    "directory's rehearsal.safetensors if there is one, none = off, or a file",
    "online_distill_rehearsal_share": "the share of each training batch drawn from the rehearsal set",
}
FLAG_OPTIONS = {
    "speculative_algorithm": {"type": str.lower, "choices": list(ALGORITHMS)},
    "draft_runner": {"choices": list(RUNNERS)},
    "attention_backend": {"choices": list(ATTENTION_BACKENDS)},
}


def parse_args(argv=None) -> tuple[DraftConfig, dict]:
    ap = EnvArgumentParser(prog="python -m draft_service", description=__doc__, env_prefix="SPECMESH_DRAFT_")
    d = DraftConfig(model_path="-")
    ap.flag("--model-path", default="", help="local HF checkpoint directory of the draft model (standalone)")
    add_server_flags(ap, d.host, d.port)
    ap.flag("--verify-address", default="", help="default verify replica host:port (a request may name another)")
    add_config_flags(ap, d, FLAG_HELP, FLAG_OPTIONS)
    add_process_flags(ap, metrics_port=9465)
    add_service_flags(ap)
    return parse_config(ap, DraftConfig, argv)


def debug_draft_delay(argv=None) -> tuple[list[str], float]:
    """TEST KNOBS, not for serving: `--debug-draft-delay-ms MS` makes every batched draft forward MS slower,
    `--debug-draft-slowdown X` X times as slow (it waits X - 1 times what the forward took, so the draft stays
    X times slower however loaded the machine is), as a slower draft model would be, so that tests and
    `specmesh profile`'s checks can stage a draft-bound stack. Also SPECMESH_DRAFT_DEBUG_DRAFT_DELAY_MS /
    _SLOWDOWN. Hidden from --help; returns the other flags and the delay in ms."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--debug-draft-delay-ms", type=float, default=float(os.environ.get(DEBUG_DELAY_ENV, 0)))
    pre.add_argument("--debug-draft-slowdown", type=float, default=float(os.environ.get(DEBUG_SLOWDOWN_ENV, 1)))
    known, rest = pre.parse_known_args(argv)
    delay_s, extra = known.debug_draft_delay_ms / 1000, max(0.0, known.debug_draft_slowdown - 1)
    if delay_s > 0 or extra > 0:
        forward = DraftBatcher._forward

        def slowed(self, *args, **kw):
            t0 = time.perf_counter()
            out = forward(self, *args, **kw)
            time.sleep(delay_s + extra * (time.perf_counter() - t0))
            return out

        DraftBatcher._forward = slowed  # type: ignore[method-assign]
    return rest, known.debug_draft_delay_ms


def main(argv=None) -> None:
    argv, _delay_ms = debug_draft_delay(argv)
    config, process = parse_args(argv)
    run_service("draft_service", build_server, config, process)


if __name__ == "__main__":
    main()
