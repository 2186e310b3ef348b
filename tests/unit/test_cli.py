"""`specmesh serve`'s flags: SGLang's spellings map to the same launch plan, the rest is refused."""

import pytest

from specmesh.cli import UsageError, parser, plan_from_args
from specmesh.profile.analysis import Acceptance, serve_command


def plan(*args: str):
    return plan_from_args(parser().parse_args(["serve", *args]))


def test_sglang_spellings_give_the_same_plan():
    ours = plan(
        "--model-path", "T", "--speculative-draft-model-path", "D", "--speculative-num-steps", "5",
        "--served-model-name", "m", "--verify-replicas", "2", "--draft-replicas", "2",
    )  # fmt: skip
    sglang = plan(
        "--model", "T", "--speculative-algorithm", "EAGLE", "--speculative-draft-model", "D",
        "--speculative-num-draft-tokens", "6", "--speculative-eagle-topk", "1", "--tp", "1", "--dp", "2",
        "--model-name", "m",
    )  # fmt: skip
    assert ours == sglang
    assert (ours.target, ours.draft, ours.algorithm, ours.num_steps) == ("T", "D", "standalone", 5)
    ngram = plan("--model-path", "T", "--speculative-algorithm", "NGRAM")
    assert (ngram.algorithm, ngram.draft) == ("ngram", None)


def test_service_settings_map_to_service_flags():
    p = plan(
        "--model-path", "T", "--draft-model", "D", "--context-length", "2048", "--random-seed", "7",
        "--max-running-requests", "32", "--verify-arg=--batch-wait-ms 5", "--draft-arg=--no-adaptive",
        "--gateway-arg=--max-queue=9",
    )  # fmt: skip
    assert p.verify_args == ["--seed", "7", "--max-model-len", "2048", "--batch-wait-ms", "5"]
    assert p.draft_args == ["--no-adaptive"]
    assert p.gateway_args == ["--max-concurrency", "32", "--max-queue=9"]


def test_speculation_limit_under_load_by_device_or_flag():
    """vLLM's --speculative-disable-by-batch-size reaches the gateway; left out, the stack sets it by device
    (speculation off past one stream per verify replica on a CPU, never off on a GPU)."""
    from specmesh.stack import _draft_speculation_limit, _speculation_limit

    p = plan("--model-path", "T", "--draft-model", "D", "--speculative-disable-by-batch-size", "3")
    assert p.gateway_args == ["--speculative-disable-by-batch-size", "3"] and _speculation_limit(p) == []
    assert _draft_speculation_limit(p) == ["--speculative-disable-by-batch-size", "3"]  # the draft's per-round side
    cpu = plan("--model-path", "T", "--draft-model", "D", "--device", "cpu")
    assert _speculation_limit(cpu) == _draft_speculation_limit(cpu) == ["--speculative-disable-by-batch-size", "1"]
    gpu = plan("--model-path", "T", "--draft-model", "D", "--device", "cuda:0")
    assert _speculation_limit(gpu) == _draft_speculation_limit(gpu) == ["--speculative-disable-by-batch-size", "0"]
    with pytest.raises(UsageError, match="speculative-disable-by-batch-size"):
        plan("--model-path", "T", "--draft-model", "D", "--speculative-disable-by-batch-size", "-1")


def test_api_keys_come_from_a_file_or_the_environment(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("sk-one\nsk-two, sk-three\n")
    assert plan("--model-path", "T", "--draft-model", "D", "--api-key-file", str(keys)).api_keys == (
        "sk-one,sk-two,sk-three"
    )
    monkeypatch.setenv("SPECMESH_API_KEY", "sk-env")
    p = plan("--model-path", "T", "--draft-model", "D")
    assert p.api_keys == "sk-env" and p.public()["api_keys"] is True  # the record never holds a key
    with pytest.raises(UsageError, match="command line"):
        plan("--model-path", "T", "--draft-model", "D", "--api-key", "sk-x")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-path", "T"], "a draft is needed"),
        (["--draft-model", "D"], "--model-path DIR"),
        (["--model-path", "T", "--speculative-algorithm", "ngram", "--draft-model", "D"], "give no draft"),
        (["--model-path", "T", "--speculative-algorithm", "medusa"], "not one of"),
        (["--model-path", "T", "--draft-model", "D", "--speculative-eagle-topk", "4"], "chain"),
        (["--model-path", "T", "--draft-model", "D", "--speculative-num-steps", "40"], "[0, 32]"),
    ],
)
def test_refusals(args, message):
    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan(*args)


def test_acceptance_model_is_exact_for_a_fixed_k():
    """Rounds of K = 4 with i.i.d. acceptance α: per-position counts give back α and E(K)."""
    alpha, rounds = 0.7, 10000
    drafted = [rounds] * 4
    accepted = [rounds * alpha ** (i + 1) for i in range(4)]
    acc = Acceptance(drafted, accepted)
    assert acc.alpha == pytest.approx(alpha)
    assert acc.conditional == pytest.approx([alpha] * 4)
    assert acc.expected_tokens(4) == pytest.approx((1 - alpha**5) / (1 - alpha))
    assert acc.expected_tokens(6) == pytest.approx((1 - alpha**7) / (1 - alpha))  # α carries on past K
    assert acc.expected_tokens(2.5) == pytest.approx((acc.expected_tokens(2) + acc.expected_tokens(3)) / 2)


def test_serve_command_applies_changes_to_the_recorded_plan():
    record = {"plan": plan("--model-path", "T", "--draft-model", "D", "--speculative-num-steps", "12").public()}
    cmd = serve_command(record, speculative_num_steps=4, verify_arg="--batch-wait-ms=10")
    assert cmd == (
        "specmesh serve --model-path T --speculative-draft-model-path D --speculative-num-steps 4 "
        "--verify-arg=--batch-wait-ms=10"
    )
