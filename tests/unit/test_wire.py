"""specmesh.wire: every domain object survives its trip through protobuf, and a malformed message is refused
with InvalidArgument naming the field (never a bare ValueError, which would answer INTERNAL)."""

import pytest
import torch

from specmesh import wire
from specmesh.domain import BatchLoad, DraftBlock, Finished, Opened, SpecStats, Tokens, Verdict
from specmesh.errors import InvalidArgument
from specmesh.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, verify_pb2


def through_bytes(pb):
    """The message as the peer parses it."""
    return type(pb).FromString(pb.SerializeToString())


# sampling parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(
            temperature=0.5,
            top_k=40,
            top_p=0.875,
            seed=2**63 - 1,
            max_tokens=300,
            stop_token_ids=(2, 7),
            stop=("\n\n", "END"),
            ignore_eos=True,
        ),
        SamplingParams(seed=0),
    ],
)
def test_params_round_trip(params):  # floats exact in float32, the wire type
    assert wire.params_from_pb(through_bytes(wire.params_to_pb(params))) == params


def test_unset_params_take_the_documented_defaults():
    params = wire.params_from_pb(common_pb2.SamplingParams())
    assert params == SamplingParams(temperature=1.0, top_p=1.0, seed=None, max_tokens=DEFAULT_MAX_TOKENS)
    # temperature 0 is greedy, not "unset": the field has presence
    assert wire.params_from_pb(common_pb2.SamplingParams(temperature=0.0)).temperature == 0.0


@pytest.mark.parametrize(
    "pb, field",
    [
        (common_pb2.SamplingParams(temperature=-1.0), "temperature"),
        (common_pb2.SamplingParams(temperature=101.0), "temperature"),
        (common_pb2.SamplingParams(top_p=0.0), "top_p"),
        (common_pb2.SamplingParams(top_p=1.5), "top_p"),
        (common_pb2.SamplingParams(top_k=2**31), "top_k"),
        (common_pb2.SamplingParams(seed=2**63), "seed"),
        (common_pb2.SamplingParams(stop=[""]), "stop"),
        (common_pb2.SamplingParams(stop=["x"] * 17), "stop"),
    ],
)
def test_bad_params_raise_invalid_argument_naming_the_field(pb, field):
    with pytest.raises(InvalidArgument, match=field):
        wire.params_from_pb(pb)


def test_stop_token_ids_are_checked_against_the_vocabulary():
    pb = common_pb2.SamplingParams(stop_token_ids=[3, 100])
    assert wire.params_from_pb(pb).stop_token_ids == (3, 100)
    with pytest.raises(InvalidArgument, match="stop_token_ids"):
        wire.params_from_pb(pb, vocab_size=100)


# draft blocks and verdicts -------------------------------------------------------------------------------


def assert_same_block(got: DraftBlock, want: DraftBlock):
    assert got.token_ids == want.token_ids
    if want.q_ids is None:
        assert got.q_ids is None and got.q_probs is None
    else:
        assert got.q_ids.dtype == torch.long and got.q_probs.dtype == torch.float32
        assert torch.equal(got.q_ids, want.q_ids) and torch.equal(got.q_probs, want.q_probs)


def test_dense_block_round_trip():
    # [K=3, S=2]; -1 pads the last row, which had a single-entry support
    q_ids = torch.tensor([[5, 9], [1, 2], [7, -1]])
    q_probs = torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]])
    block = DraftBlock([5, 2, 7], q_ids, q_probs)
    pb = through_bytes(wire.block_to_pb(block, "s-1", epoch=4, base_position=12))
    assert (pb.session_id, pb.epoch, pb.base_position, pb.q_width) == ("s-1", 4, 12, 2)
    assert list(pb.q_ids) == [5, 9, 1, 2, 7, -1]
    assert_same_block(wire.block_from_pb(pb), block)


@pytest.mark.parametrize("block", [DraftBlock([3, 1, 4]), DraftBlock([])])
def test_point_mass_block_round_trip(block):
    pb = through_bytes(wire.block_to_pb(block, "s", epoch=0, base_position=3))
    assert not pb.q_ids and not pb.q_probs and pb.q_width == 0
    assert_same_block(wire.block_from_pb(pb), block)


@pytest.mark.parametrize(
    "fields, field",
    [
        (dict(q_ids=[1], q_probs=[1.0], q_width=1), "draft_ids"),  # probabilities without tokens
        (dict(draft_ids=[1, 2], q_ids=[1, 2], q_probs=[1.0, 1.0], q_width=0), "q_width"),
        (dict(draft_ids=[1, 2], q_ids=[1, 2, 3], q_probs=[0.5, 0.5, 1.0], q_width=2), "q_ids"),
        (dict(draft_ids=[1, 2], q_ids=[1, 2], q_probs=[1.0], q_width=1), "q_probs"),
        (dict(draft_ids=[1], q_ids=[1], q_width=1), "q_probs"),  # ids without probabilities
        (dict(draft_ids=[1], q_probs=[1.0], q_width=1), "q_ids"),  # probabilities without ids
        (dict(draft_ids=[1, 2], target_only_steps=4), "target_only_steps"),  # a run takes an empty block
    ],
)
def test_bad_block_shapes_raise_invalid_argument_naming_the_field(fields, field):
    with pytest.raises(InvalidArgument, match=field):
        wire.block_from_pb(verify_pb2.VerifyRequest(session_id="s", **fields))


@pytest.mark.parametrize(
    "verdict",
    [
        Verdict([4, 5, 6], 2, 3, None, epoch=7, load=BatchLoad(0.001, 0.02, 5)),
        Verdict([9], 0, 0, "length", epoch=1, deadline=True, load=BatchLoad(0.0, 0.01, 1)),
        Verdict([], 0, 0, None, epoch=3, stale=True),
        Verdict([1, 2], 1, 4, "stop", epoch=0),
    ],
)
def test_verdict_round_trip(verdict):
    assert wire.verdict_from_pb(through_bytes(wire.verdict_to_pb(verdict))) == verdict


# statistics, finish reasons and generation streams ---------------------------------------------------------


STATS = SpecStats(
    rounds=5,
    drafts=4,
    drafted=12,
    accepted=9,
    drafted_per_pos=[4, 4, 4],
    accepted_per_pos=[4, 3, 2],
    draft_seconds=0.25,
    verify_seconds=0.5,
    by_method={"model": [3, 8, 5], "suffix": [1, 4, 4]},
)


def test_stats_round_trip():
    assert wire.stats_from_pb(through_bytes(wire.stats_to_pb(STATS))) == STATS
    assert wire.stats_from_pb(common_pb2.SpecStats()) == SpecStats()


def test_stats_by_method_merge_and_show():
    total = SpecStats()
    total.merge(STATS)
    total.merge(SpecStats(drafts=1, drafted=2, accepted=1, by_method={"suffix": [1, 2, 1]}))
    assert total.by_method == {"model": [3, 8, 5], "suffix": [2, 6, 5]}
    assert total.as_dict()["by_method"]["suffix"] == {"drafts": 2, "drafted": 6, "accepted": 5}


@pytest.mark.parametrize("reason", [None, "stop", "length", "cancelled"])
def test_finish_reason_round_trip(reason):
    assert wire.finish_from_pb(wire.finish_to_pb(reason)) == reason


def test_every_finish_reason_of_the_contract_is_mapped():
    assert set(wire.FINISH_FROM_PB) == set(common_pb2.FinishReason.values())


def test_an_unknown_finish_reason_raises_invalid_argument():
    with pytest.raises(InvalidArgument, match="finish_reason"):
        wire.finish_from_pb(99)


@pytest.mark.parametrize(
    "event",
    [
        Opened("chat-1", 12, 8),
        Tokens([1, 2, 3]),
        Finished("length", STATS),
        Finished("stop"),
        Finished("stop", STATS, speculation_pays=False),
        Finished("length", speculation_pays=True),
    ],
)
@pytest.mark.parametrize(
    "response_type", [draft_pb2.DraftServiceGenerateResponse, verify_pb2.VerifyServiceGenerateResponse]
)
def test_generation_event_round_trip(event, response_type):
    pb = through_bytes(wire.event_to_pb(event, response_type))
    assert pb.WhichOneof("chunk") == type(event).__name__.lower()
    assert wire.event_from_pb(pb) == event


def test_a_finished_chunk_without_speculation_carries_no_stats():
    pb = wire.event_to_pb(Finished("length"), verify_pb2.VerifyServiceGenerateResponse)
    assert not pb.finished.HasField("stats")
    pb = wire.event_to_pb(Finished("length", SpecStats(rounds=1)), draft_pb2.DraftServiceGenerateResponse)
    assert pb.finished.HasField("stats")
    assert not pb.finished.HasField("speculation_pays")  # not measured is not "false"
    assert wire.event_from_pb(through_bytes(pb)).speculation_pays is None


@pytest.mark.parametrize(
    "pb, field",
    [
        (draft_pb2.DraftServiceGenerateResponse(), "chunk"),
        (draft_pb2.DraftServiceGenerateResponse(finished=common_pb2.GenerationFinished()), "finish_reason"),
    ],
)
def test_bad_chunks_raise_invalid_argument(pb, field):
    with pytest.raises(InvalidArgument, match=field):
        wire.event_from_pb(pb)
