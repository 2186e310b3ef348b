"""A typed client for specmesh.v1.GatewayService: protobuf in, dataclasses out."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_CANCELLED: "cancelled",
}

Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV cache was reused (a later turn of a session)


@dataclass(frozen=True)
class SpecStats:
    """Speculation statistics; vLLM's definitions (acceptance rate = accepted / drafted, mean accepted
    length = 1 + accepted / drafts)."""

    rounds: int
    drafted: int
    accepted: int
    drafts: int
    drafted_per_pos: tuple[int, ...]
    accepted_per_pos: tuple[int, ...]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


@dataclass(frozen=True)
class SpeculativeDecoding:
    """vLLM's per-request speculative-decoding metrics (its names): a step is a round that verified a draft
    block. `per_step_*`: empty unless the gateway runs --per-request-spec-decode-metrics detailed."""

    num_spec_tokens: int  # the K cap
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float  # 1 + accepted / steps (the bonus token included)
    draft_acceptance_rate: float  # accepted / drafted
    acceptance_histogram: tuple[int, ...]  # [num_spec_tokens + 1] steps that accepted exactly j draft tokens
    acceptance_histogram_by_draft_length: Mapping[int, tuple[int, ...]]  # the same by the steps' draft length
    per_step_accepted: tuple[int, ...] = ()
    per_step_drafted: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """A whole generation (`generate`)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length" | "cancelled"
    session_id: str  # the request's session ("" when none: no KV cache kept for a next turn)
    usage: Usage
    stats: SpecStats
    failovers: int = 0  # replica failovers the generation survived
    target_only: bool = False  # decoded without a draft replica
    speculative_decoding: SpeculativeDecoding | None = None  # None when the gateway reports none
    handed_off: bool = False  # a goodput probe: speculated, then decoded the rest target-only


@dataclass(frozen=True)
class Chunk:
    """One piece of a streamed generation (`generate_stream`): new text and token ids; the last chunk also
    has finish_reason, usage and stats (None before it)."""

    text: str
    token_ids: tuple[int, ...]
    session_id: str
    finish_reason: str | None = None
    usage: Usage | None = None
    stats: SpecStats | None = None
    failovers: int = 0
    target_only: bool = False
    speculative_decoding: SpeculativeDecoding | None = None
    handed_off: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _usage(pb) -> Usage:
    return Usage(pb.prompt_tokens, pb.completion_tokens, pb.cached_prompt_tokens)


def _stats(pb) -> SpecStats:
    return SpecStats(
        pb.rounds, pb.drafted, pb.accepted, pb.drafts, tuple(pb.drafted_per_pos), tuple(pb.accepted_per_pos)
    )


def _speculative_decoding(pb) -> SpeculativeDecoding | None:
    """A response's (or finished chunk's) speculative_decoding field, None when unset."""
    if not pb.HasField("speculative_decoding"):
        return None
    m = pb.speculative_decoding
    return SpeculativeDecoding(
        num_spec_tokens=m.num_spec_tokens,
        num_spec_steps=m.num_spec_steps,
        num_draft_tokens=m.num_draft_tokens,
        num_accepted_draft_tokens=m.num_accepted_draft_tokens,
        mean_acceptance_length=m.mean_acceptance_length,
        draft_acceptance_rate=m.draft_acceptance_rate,
        acceptance_histogram=tuple(m.acceptance_histogram),
        acceptance_histogram_by_draft_length={
            k: tuple(c.rounds) for k, c in sorted(m.acceptance_histogram_by_draft_length.items())
        },
        per_step_accepted=tuple(m.per_step_accepted),
        per_step_drafted=tuple(m.per_step_drafted),
    )


@dataclass
class SpecmeshClient:
    """`SpecmeshClient("host:50070")`; `api_key` is sent as `authorization: Bearer <key>`; `tls`: False for
    a plaintext channel, True for TLS with the default roots, or your own `grpc.ChannelCredentials`
    (e.g. `grpc.ssl_channel_credentials(root_certificates=..., private_key=..., certificate_chain=...)`).
    `timeout`: the default deadline of each call in seconds. Use it as a context manager, or `close()`."""

    target: str
    api_key: str | None = None
    tls: bool | grpc.ChannelCredentials = False
    timeout: float | None = 300.0
    model: str = ""  # when set, the gateway checks it names the served model
    options: Sequence[tuple[str, Any]] = ()  # grpc channel options
    _channel: grpc.Channel = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tls is False:
            self._channel = grpc.insecure_channel(self.target, options=list(self.options))
        else:
            creds = grpc.ssl_channel_credentials() if self.tls is True else self.tls
            self._channel = grpc.secure_channel(self.target, creds, options=list(self.options))
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> SpecmeshClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self,
        kind,
        prompt: str | None,
        messages: Sequence[Message] | None,
        prompt_ids: Sequence[int] | None,
        session_id: str | None,
        num_speculative_tokens: int | None,
        params: dict[str, Any],
    ):
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages and prompt_ids")
        stop = params.pop("stop", None)
        if isinstance(stop, str):
            stop = [stop]
        sampling = common_pb2.SamplingParams(**params, **({"stop": stop} if stop else {}))
        request = kind(model=self.model, params=sampling, session_id=session_id or "")
        if prompt is not None:
            request.prompt = prompt
        elif prompt_ids is not None:
            request.prompt_ids.extend(prompt_ids)
        else:
            assert messages is not None
            request.messages.extend(gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
        if num_speculative_tokens is not None:
            request.num_speculative_tokens = num_speculative_tokens
        return request

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        prompt_ids: Sequence[int] | None = None,
        session_id: str | None = None,
        num_speculative_tokens: int | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Generation:
        """One whole generation. `params` are SamplingParams fields (max_tokens, temperature, top_p, top_k,
        stop, seed, ignore_eos, ...). Errors are `grpc.RpcError` with the gateway's status code and message
        (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE, ...)."""
        request = self._request(
            gateway_pb2.GatewayServiceGenerateRequest,
            prompt,
            messages,
            prompt_ids,
            session_id,
            num_speculative_tokens,
            params,
        )
        r = self._stub.Generate(request, timeout=timeout or self.timeout, metadata=self._metadata)
        return Generation(
            text=r.text,
            token_ids=tuple(r.token_ids),
            finish_reason=_FINISH.get(r.finish_reason, "unspecified"),
            session_id=r.session_id,
            usage=_usage(r.usage),
            stats=_stats(r.stats),
            failovers=r.failovers,
            target_only=r.target_only,
            speculative_decoding=_speculative_decoding(r),
            handed_off=r.handed_off,
        )

    def generate_stream(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        prompt_ids: Sequence[int] | None = None,
        session_id: str | None = None,
        num_speculative_tokens: int | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> Iterator[Chunk]:
        """The generation as it is produced: chunks of new text and ids, the last one `finished`. Leaving
        the loop early cancels the call (and the work behind it)."""
        request = self._request(
            gateway_pb2.GatewayServiceGenerateStreamRequest,
            prompt,
            messages,
            prompt_ids,
            session_id,
            num_speculative_tokens,
            params,
        )
        call = self._stub.GenerateStream(request, timeout=timeout or self.timeout, metadata=self._metadata)
        sid = session_id or ""
        try:
            for r in call:
                if r.WhichOneof("chunk") == "delta":
                    yield Chunk(r.delta.text, tuple(r.delta.token_ids), sid)
                else:
                    f = r.finished
                    yield Chunk(
                        f.text,
                        tuple(f.token_ids),
                        f.session_id,
                        finish_reason=_FINISH.get(f.finish_reason, "unspecified"),
                        usage=_usage(f.usage),
                        stats=_stats(f.stats),
                        failovers=f.failovers,
                        target_only=f.target_only,
                        speculative_decoding=_speculative_decoding(f),
                        handed_off=f.handed_off,
                    )
        finally:
            call.cancel()  # a no-op after the end; frees the stream when the caller stops early
