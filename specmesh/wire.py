"""Translation between specmesh.v1 protobuf messages and the core's domain objects, in one place.

Every service converts at its boundary with these functions and works with domain objects inside:
`SamplingParams` (specmesh.sampling) and `DraftBlock`, `Verdict`, `SpecStats` and the generation events
`Opened` / `Tokens` / `Finished` (specmesh.domain). The domain never imports protobuf, so each boundary is
a `*_to_pb` / `*_from_pb` pair here rather than methods on the domain dataclasses.

Conversions that read a caller's input raise `InvalidArgument` with a message naming the field, which
every front answers with INVALID_ARGUMENT (HTTP 400); a plain ValueError would be an internal error.
"""

from __future__ import annotations

import json
from typing import Any, TypeAlias

import torch

from specmesh.domain import (
    BatchLoad,
    DraftBlock,
    Finished,
    GenerationEvent,
    Opened,
    SpecStats,
    TokenLogprob,
    Tokens,
    Verdict,
)
from specmesh.errors import InvalidArgument
from specmesh.rejection.limits import MAX_SPEC_LEN
from specmesh.sampling import DEFAULT_MAX_TOKENS, SamplingParams, StructuredSpec
from specmesh.v1 import common_pb2, verify_pb2

FinishReasonPb: TypeAlias = common_pb2.FinishReason

FINISH_TO_PB: dict[str | None, FinishReasonPb] = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
    "handed_off": common_pb2.FINISH_REASON_HANDED_OFF,
}
FINISH_FROM_PB: dict[int, str | None] = {v: k for k, v in FINISH_TO_PB.items()}


def finish_to_pb(reason: str | None) -> FinishReasonPb:
    """The FinishReason of a domain finish reason (None = not finished)."""
    return FINISH_TO_PB[reason]


def finish_from_pb(value: int) -> str | None:
    """The domain finish reason of a FinishReason; a value this version does not know is refused (proto3
    enums are open, so a newer peer could send one)."""
    try:
        return FINISH_FROM_PB[value]
    except KeyError:
        raise InvalidArgument(f"finish_reason: unknown value {value}") from None


# Sampling parameters ---------------------------------------------------------------------------------


def params_from_pb(pb: common_pb2.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """Validated SamplingParams; unset fields take the defaults the proto documents."""
    params = SamplingParams(
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_k=pb.top_k,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        seed=pb.seed if pb.HasField("seed") else None,
        max_tokens=pb.max_tokens or DEFAULT_MAX_TOKENS,
        stop_token_ids=tuple(pb.stop_token_ids),
        stop=tuple(pb.stop),
        ignore_eos=pb.ignore_eos,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        min_p=pb.min_p,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        min_tokens=pb.min_tokens,
        bad_words=tuple(tuple(w.token_ids) for w in pb.bad_words),
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prior_output_tokens=pb.prior_output_tokens,
        structured=structured_from_pb(pb.structured) if pb.HasField("structured") else None,
    )
    try:
        return params.validate(vocab_size)
    except InvalidArgument:
        raise
    except ValueError as e:  # validate's messages name the field; the class decides the status code
        raise InvalidArgument(str(e)) from None


def params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        max_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids,
        stop=params.stop,
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
        bad_words=[common_pb2.TokenSequence(token_ids=w) for w in params.bad_words],
        prior_output_tokens=params.prior_output_tokens,
    )
    if params.seed is not None:
        pb.seed = params.seed
    if params.repetition_penalty != 1.0:
        pb.repetition_penalty = params.repetition_penalty
    if params.logprobs is not None:
        pb.logprobs = params.logprobs
    if params.structured is not None:
        pb.structured.CopyFrom(structured_to_pb(params.structured))
    return pb


def structured_from_pb(pb: common_pb2.StructuredOutput) -> StructuredSpec | None:
    kind = pb.WhichOneof("format")
    if kind is None:
        return None
    if kind == "choice":
        return StructuredSpec("choice", json.dumps(list(pb.choice.choices)), "structured.choice")
    if kind == "json_object":
        return StructuredSpec("json_object", "", "structured.json_object")
    return StructuredSpec(kind, getattr(pb, kind), f"structured.{kind}")


def structured_to_pb(spec: StructuredSpec) -> common_pb2.StructuredOutput:
    if spec.kind == "choice":
        return common_pb2.StructuredOutput(choice=common_pb2.StructuredChoice(choices=json.loads(spec.value)))
    if spec.kind == "json_object":
        return common_pb2.StructuredOutput(json_object=True)
    if spec.kind == "regex":
        return common_pb2.StructuredOutput(regex=spec.value)
    return common_pb2.StructuredOutput(json_schema=spec.value)


# Log-probabilities -----------------------------------------------------------------------------------


def logprobs_to_pb(logprobs: list[TokenLogprob] | None) -> list[common_pb2.TokenLogprob]:
    return [
        common_pb2.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )
        for lp in logprobs or ()
    ]


def logprobs_from_pb(pbs, n_tokens: int) -> list[TokenLogprob] | None:
    """The log-probabilities of `n_tokens` tokens; None when none were sent (not asked for). A count that
    does not match the tokens, or top lists of different lengths, is refused."""
    if not len(pbs):
        return None
    if len(pbs) != n_tokens:
        raise InvalidArgument(f"logprobs: {len(pbs)} entries for {n_tokens} tokens")
    out = []
    for pb in pbs:
        if len(pb.top_ids) != len(pb.top_logprobs):
            raise InvalidArgument("logprobs: top_ids and top_logprobs differ in length")
        out.append(TokenLogprob(pb.token_id, pb.logprob, tuple(zip(pb.top_ids, pb.top_logprobs, strict=True))))
    return out


def spec_len_from_pb(pb) -> int | None:
    """A Generate request's `num_speculative_tokens` (DraftService or GatewayService): None when unset (the
    service's choice), 0 for target-only decoding, else the most draft tokens per block. The bound is the
    service's to check, with the rest of the request."""
    return pb.num_speculative_tokens if pb.HasField("num_speculative_tokens") else None


# The Verify stream: draft blocks up, verdicts down ---------------------------------------------------


def block_to_pb(
    block: DraftBlock,
    session_id: str,
    epoch: int,
    base_position: int,
    target_only_steps: int = 0,
    chained_after: int | None = None,
) -> verify_pb2.VerifyRequest:
    """One VerifyRequest: the block's ids and, when it has them, its sparse q flattened row-major [K * S];
    an empty block may ask for a run of `target_only_steps`; `chained_after`: a chained block's assumed last
    token (see the proto)."""
    pb = verify_pb2.VerifyRequest(
        session_id=session_id,
        epoch=epoch,
        base_position=base_position,
        draft_ids=block.token_ids,
        target_only_steps=target_only_steps,
        chained_after=chained_after,
    )
    if block.q_ids is not None and block.q_probs is not None and block.k:
        pb.q_ids.extend(block.q_ids.flatten().tolist())
        pb.q_probs.extend(block.q_probs.flatten().tolist())
        pb.q_width = block.q_ids.size(1)
    return pb


def block_from_pb(pb: verify_pb2.VerifyRequest) -> DraftBlock:
    """The block a VerifyRequest carries. Shape errors raise InvalidArgument here; the values (ids in the
    vocabulary, rows summing to 1, ...) are the verifier's to check (specmesh.rejection.validate_block)."""
    ids = list(pb.draft_ids)
    k = len(ids)
    if k and pb.target_only_steps > 1:
        raise InvalidArgument(
            f"target_only_steps: {pb.target_only_steps} steps asked with {k} draft_ids; a run of target-only "
            "steps takes an empty block"
        )
    if not len(pb.q_ids) and not len(pb.q_probs):
        return DraftBlock(ids)
    if not k:
        raise InvalidArgument("q_ids and q_probs: draft probabilities sent without draft_ids")
    width = pb.q_width
    if width < 1 or len(pb.q_ids) != k * width or len(pb.q_probs) != k * width:
        raise InvalidArgument(
            f"q_ids and q_probs must both hold len(draft_ids) * q_width = {k} * {width} "
            f"values, got {len(pb.q_ids)} and {len(pb.q_probs)}"
        )
    return DraftBlock(
        ids,
        torch.tensor(list(pb.q_ids), dtype=torch.long).view(k, width),
        torch.tensor(list(pb.q_probs), dtype=torch.float32).view(k, width),
    )


def verdict_to_pb(v: Verdict) -> verify_pb2.VerifyResponse:
    return verify_pb2.VerifyResponse(
        epoch=v.epoch,
        num_drafted=v.num_drafted or 0,
        num_accepted=v.num_accepted,
        token_ids=v.tokens,
        finish_reason=finish_to_pb(v.finish_reason),
        stale=v.stale,
        deadline=v.deadline,
        timings=verify_pb2.VerifyTimings(
            queue_seconds=v.load.queue_seconds,
            batch_seconds=v.load.batch_seconds,
            batch_size=v.load.batch_size,
            batch_tokens=v.load.batch_tokens,
            queue_depth=v.load.queue_depth,
        ),
        logprobs=logprobs_to_pb(v.logprobs),
    )


def verdict_from_pb(pb: verify_pb2.VerifyResponse) -> Verdict:
    t = pb.timings
    return Verdict(
        list(pb.token_ids),
        pb.num_accepted,
        pb.num_drafted,
        finish_from_pb(pb.finish_reason),
        epoch=pb.epoch,
        stale=pb.stale,
        deadline=pb.deadline,
        load=BatchLoad(t.queue_seconds, t.batch_seconds, t.batch_size, t.batch_tokens, t.queue_depth),
        logprobs=logprobs_from_pb(pb.logprobs, len(pb.token_ids)),
    )


# Statistics and generation streams -------------------------------------------------------------------


# The SpecStats fields that travel, under the same names in the message (the pipelining counts stay with
# the draft service that drafted ahead).
STATS_FIELDS = ("rounds", "drafts", "drafted", "accepted", "draft_seconds", "verify_seconds", "num_spec_tokens")
STATS_LIST_FIELDS = ("drafted_per_pos", "accepted_per_pos")
STATS_STEP_FIELDS = ("step_drafted", "step_accepted")  # None (not kept) travels as empty


def stats_to_pb(stats: SpecStats) -> common_pb2.SpecStats:
    values: dict[str, Any] = {name: getattr(stats, name) for name in STATS_FIELDS + STATS_LIST_FIELDS}
    values.update((name, getattr(stats, name) or ()) for name in STATS_STEP_FIELDS)
    pb = common_pb2.SpecStats(**values)
    for k, counts in stats.accepted_by_draft_length.items():
        pb.accepted_by_draft_length[k].rounds.extend(counts)
    for method, (drafts, drafted, accepted) in stats.by_method.items():
        pb.by_method[method].CopyFrom(common_pb2.MethodCounts(drafts=drafts, drafted=drafted, accepted=accepted))
    return pb


def stats_from_pb(pb: common_pb2.SpecStats) -> SpecStats:
    values: dict[str, Any] = {name: getattr(pb, name) for name in STATS_FIELDS}
    values.update((name, list(getattr(pb, name))) for name in STATS_LIST_FIELDS)
    # Kept one by one only when they came: an empty list and "not kept" read alike off the wire.
    values.update((name, list(getattr(pb, name)) or None) for name in STATS_STEP_FIELDS)
    # No draft length beyond what any verifier takes: a peer's larger one would size histograms by it.
    values["num_spec_tokens"] = min(pb.num_spec_tokens, MAX_SPEC_LEN)
    rows = pb.accepted_by_draft_length.items()
    values["accepted_by_draft_length"] = {k: list(c.rounds) for k, c in rows if 0 < k <= MAX_SPEC_LEN}
    values["by_method"] = {m: [c.drafts, c.drafted, c.accepted] for m, c in pb.by_method.items()}
    return SpecStats(**values)


def event_to_pb(event: GenerationEvent, response_type: type) -> Any:
    """`response_type` is DraftServiceGenerateResponse or VerifyServiceGenerateResponse: the same
    `oneof chunk` in both."""
    if isinstance(event, Opened):
        return response_type(
            opened=common_pb2.GenerationOpened(
                session_id=event.session_id,
                prompt_tokens=event.prompt_tokens,
                cached_prompt_tokens=event.cached_prompt_tokens,
            )
        )
    if isinstance(event, Tokens):
        return response_type(
            tokens=common_pb2.GenerationTokens(token_ids=event.token_ids, logprobs=logprobs_to_pb(event.logprobs))
        )
    if isinstance(event, Finished):
        pb = response_type(finished=common_pb2.GenerationFinished(finish_reason=finish_to_pb(event.finish_reason)))
        if event.stats != SpecStats():  # all zero (target-only decoding) travels as unset, so HasField tells
            pb.finished.stats.CopyFrom(stats_to_pb(event.stats))
        if event.speculation_pays is not None:
            pb.finished.speculation_pays = event.speculation_pays
        return pb
    raise TypeError(f"not a generation event: {event!r}")


def event_from_pb(pb) -> GenerationEvent:
    """The generation event a Generate stream chunk carries."""
    kind = pb.WhichOneof("chunk")
    if kind == "opened":
        o = pb.opened
        return Opened(o.session_id, o.prompt_tokens, o.cached_prompt_tokens)
    if kind == "tokens":
        ids = list(pb.tokens.token_ids)
        return Tokens(ids, logprobs_from_pb(pb.tokens.logprobs, len(ids)))
    if kind == "finished":
        reason = finish_from_pb(pb.finished.finish_reason)
        if reason is None:
            raise InvalidArgument("finished.finish_reason: a finished chunk must say why the generation ended")
        pays = pb.finished.speculation_pays if pb.finished.HasField("speculation_pays") else None
        return Finished(reason, stats_from_pb(pb.finished.stats), pays)
    raise InvalidArgument("chunk: none of opened, tokens, finished is set")
