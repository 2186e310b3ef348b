"""Translation between specmesh.v1 protobuf messages and the core's domain objects, in one place.

Every service converts at its boundary with these functions and works with domain objects inside
(`SamplingParams`, `Proposal`, `Verdict`, `SpecStats`). Conversions that read client input raise
ValueError with a message naming the field, which the servicers turn into INVALID_ARGUMENT.
"""

from __future__ import annotations

import torch

from specmesh.loop import Proposal, SpecStats
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2

FINISH_TO_PB = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "cancelled": common_pb2.FINISH_REASON_CANCELLED,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def params_from_pb(pb: common_pb2.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """Validated SamplingParams; unset optional fields take the defaults the proto documents."""
    params = SamplingParams(
        temperature=pb.temperature if pb.HasField("temperature") else 1.0,
        top_k=pb.top_k,
        top_p=pb.top_p if pb.HasField("top_p") else 1.0,
        seed=pb.seed if pb.HasField("seed") else None,
        max_tokens=pb.max_tokens or 16,
        stop_token_ids=tuple(pb.stop_token_ids),
        stop=tuple(pb.stop),
        ignore_eos=pb.ignore_eos,
    )
    return params.validate(vocab_size)


def params_to_pb(params: SamplingParams) -> common_pb2.SamplingParams:
    pb = common_pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                   max_tokens=params.max_tokens, stop_token_ids=params.stop_token_ids,
                                   stop=params.stop, ignore_eos=params.ignore_eos)
    if params.seed is not None:
        pb.seed = params.seed
    return pb


def proposal_to_pb_fields(proposal: Proposal) -> dict:
    """The DraftBlock fields that carry a proposal (ids, and the sparse q flattened [K, S])."""
    fields = {"draft_ids": proposal.token_ids}
    if proposal.q_ids is not None and proposal.k:
        fields.update(q_ids=proposal.q_ids.flatten().tolist(), q_probs=proposal.q_probs.flatten().tolist(),
                      q_width=proposal.q_ids.size(1))
    return fields


def proposal_from_pb(draft_ids, q_ids, q_probs, q_width: int) -> Proposal:
    """Rebuild a proposal; shape errors raise ValueError (value checks are the verifier's validate_block)."""
    ids = list(draft_ids)
    k = len(ids)
    if not len(q_ids) and not len(q_probs):
        return Proposal(ids)
    if not k:
        raise ValueError("draft probabilities sent without draft tokens")
    if q_width < 1 or len(q_ids) != k * q_width or len(q_probs) != k * q_width:
        raise ValueError(f"q_ids and q_probs must both hold K * q_width = {k} * {q_width} values, got "
                         f"{len(q_ids)} and {len(q_probs)}")
    return Proposal(ids, torch.tensor(list(q_ids), dtype=torch.long).view(k, q_width),
                    torch.tensor(list(q_probs), dtype=torch.float32).view(k, q_width))


def stats_to_pb(stats: SpecStats) -> common_pb2.SpecStats:
    return common_pb2.SpecStats(rounds=stats.rounds, drafts=stats.drafts, drafted=stats.drafted,
                                accepted=stats.accepted, drafted_per_pos=stats.drafted_per_pos, accepted_per_pos=stats.accepted_per_pos,
                                draft_seconds=stats.draft_seconds, verify_seconds=stats.verify_seconds)


def stats_from_pb(pb: common_pb2.SpecStats) -> SpecStats:
    return SpecStats(rounds=pb.rounds, drafts=pb.drafts, drafted=pb.drafted, accepted=pb.accepted,
                     drafted_per_pos=list(pb.drafted_per_pos), accepted_per_pos=list(pb.accepted_per_pos),
                     draft_seconds=pb.draft_seconds, verify_seconds=pb.verify_seconds)
