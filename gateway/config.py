"""The gateway's settings: `GatewayConfig`, whose fields declared with `specmesh.config.option` are also the
gateway's flags. Its own module, below everything that reads it (the router, the lifecycle, the fronts)."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh import config as flags

# The tool-call parsers `gateway.openai.tools.TOOL_CALL_PARSERS` implements (a test keeps the two equal): named
# here so that the config, which every front imports, imports none of them.
TOOL_CALL_PARSER_NAMES = ("hermes",)
# vLLM's --per-request-spec-decode-metrics levels: none, the summary, the summary and each step.
SPEC_DECODE_METRICS_LEVELS = ("none", "summary", "detailed")


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's settings; each field declared with `option` is also its flag (`python -m gateway --help`)."""

    verify: tuple[str, ...] = flags.option(
        (),
        "verify replicas, comma-separated host:port; a host that resolves to several addresses (a headless "
        "Service) gives one replica per address, re-resolved every health round",
        required=True,
    )
    draft: tuple[str, ...] = flags.option((), "draft replicas, comma-separated host:port (none = target-only)")
    model_name: str = flags.option(
        "specmesh", "the model id clients send (default: the tokenizer directory's name)", flag_default=""
    )
    speculative_num_steps: int = flags.option(
        0,
        "draft tokens per block of requests that leave num_speculative_tokens unset (0 = the draft's default)",
    )
    speculative_disable_by_batch_size: int = flags.option(  # vLLM's speculative_disable_by_batch_size
        0,
        "requests that leave num_speculative_tokens unset decode target-only while more than this many "
        "generations per healthy verify replica are in flight (0 = always speculate)",
    )
    goodput_probe_every: int = flags.option(
        8,
        "requests that leave num_speculative_tokens unset decode target-only, straight on the verify replica, "
        "while the draft replica reports that speculation measures slower than target-only (its goodput "
        "guard), or for sampled requests while the gateway measures the draft path slower end to end; every "
        "N-th of them still goes through the draft replica to keep it measuring, handed back to decode the rest "
        "here once measured losing (the interval doubling after each probe while the loss stands, up to 8N), "
        "and every N-th sampled request on the draft path goes "
        "direct to measure that side (0 = off)",
    )
    max_prompt_tokens: int = flags.option(4096, "longest prompt accepted")
    max_tokens_limit: int = flags.option(4096, "largest max_tokens accepted")
    request_timeout_s: float = flags.option(300.0, "deadline of each generation")
    max_concurrency: int = flags.option(64, "generations running at once")
    max_queue: int = flags.option(256, "generations waiting for a slot; more get 429")
    max_failovers: int = flags.option(3, "replica failovers per generation")
    health_interval_s: float = flags.option(2.0, "replica health check period")
    fail_threshold: int = flags.option(3, "failed checks that take a replica out")
    success_threshold: int = flags.option(2, "good checks that bring it back")
    load_factor: float = flags.option(1.25, "bounded-load hashing: max load / mean load")
    stall_timeout_s: float = flags.option(
        2.0,
        "longest a stream may go without a token before it continues without its draft or moves to another "
        "verify replica (0 = streams are not watched)",
    )
    stall_gap_multiple: float = flags.option(
        8.0, "a stream has stalled after this many times its mean gap between tokens (at most --stall-timeout-s)"
    )
    tokenizer_threads: int = 2  # threads that tokenize prompts, and as many that detokenize outputs
    per_request_spec_decode_metrics: str = flags.option(  # vLLM's flag, its levels; here summary by default
        "summary",
        "metrics.speculative_decoding in every answer (vLLM's per-request acceptance stats, on the last chunk "
        "of a stream with usage; null for n > 1): none, summary, or detailed (each step's drafted and "
        "accepted tokens too)",
        choices=SPEC_DECODE_METRICS_LEVELS,
    )
    max_stored_responses: int = flags.option(
        1024,
        "responses of POST /v1/responses kept for GET /v1/responses/{id} and previous_response_id, the least "
        "recently used evicted past it (0 = none kept)",
    )
    tool_call_parser: str = flags.option(
        "hermes",
        "how chat finds tool calls in a reply with tool_choice auto (hermes: <tool_call>{json}</tool_call>)",
        choices=TOOL_CALL_PARSER_NAMES,
    )
