"""`specmesh serve`'s flags: SGLang's spellings map to the same launch plan, the rest is refused."""

import os
import re
from pathlib import Path

import pytest

from specmesh.cli import UsageError, parser, plan_from_args
from specmesh.profile.analysis import Acceptance, serve_command
from specmesh.stack import draft_argv, gateway_argv, verify_argv

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


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


def values(argv: list[str], flag: str) -> list[str]:
    """Every value `flag` has in `argv` (the last one wins)."""
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag] + [
        a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")
    ]


def test_speculation_limit_under_load_by_device_or_flag():
    """vLLM's --speculative-disable-by-batch-size reaches the gateway; left out, the stack sets it by device
    (speculation off past one stream per verify replica on a CPU, never off on a GPU)."""
    limit = "--speculative-disable-by-batch-size"
    p = plan("--model-path", "T", "--draft-model", "D", "--speculative-disable-by-batch-size", "3", "--device", "cpu")
    assert p.gateway_args == [limit, "3"] and values(gateway_argv(p, ["v:1"], ["d:1"]), limit) == ["3"]
    assert values(draft_argv(p, "v:1", ["v:1"]), limit) == ["3"]  # the draft's per-round side
    cpu = plan("--model-path", "T", "--draft-model", "D", "--device", "cpu")
    assert values(gateway_argv(cpu, ["v:1"], []), limit) == values(draft_argv(cpu, "v:1", ["v:1"]), limit) == ["1"]
    gpu = plan("--model-path", "T", "--draft-model", "D", "--device", "cuda:0")
    assert values(gateway_argv(gpu, ["v:1"], []), limit) == values(draft_argv(gpu, "v:1", ["v:1"]), limit) == ["0"]
    given = plan("--model-path", "T", "--draft-model", "D", "--device", "cpu", f"--gateway-arg={limit}=5")
    assert values(draft_argv(given, "v:1", ["v:1"]), limit) == ["5"]  # the gateway's value, given through
    with pytest.raises(UsageError, match="speculative-disable-by-batch-size"):
        plan("--model-path", "T", "--draft-model", "D", "--speculative-disable-by-batch-size", "-1")


def test_each_service_gets_the_settings_the_launcher_decides():
    p = plan(
        "--model-path", "T", "--draft-model", "D", "--device", "cpu", "--draft-threads", "2",
        "--served-model-name", "m", "--host", "0.0.0.0", "--port", "8001", "--log-level", "DEBUG",
        "--verify-arg=--max-batch-size 4",
    )  # fmt: skip
    verify = verify_argv(p)
    assert verify[:8] == ["--model-path", "T", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    assert verify[-4:] == ["--log-level", "DEBUG", "--max-batch-size", "4"]  # passed through last: they win
    draft = draft_argv(p, "127.0.0.1:1", ["127.0.0.1:1", "127.0.0.1:2"])
    assert values(draft, "--verify-address") == ["127.0.0.1:1"]
    assert values(draft, "--verify-allow") == ["127.0.0.1:1,127.0.0.1:2"]
    assert values(draft, "--threads") == ["2"] and values(draft, "--device") == ["cpu"]
    gateway = gateway_argv(p, ["127.0.0.1:1"], ["127.0.0.1:3"])
    assert gateway[:6] == ["--host", "0.0.0.0", "--port", "8001", "--grpc-port", "50070"]
    assert values(gateway, "--model-name") == ["m"] and values(gateway, "--tokenizer-path") == ["T"]
    assert not any(a.startswith("--tls") or a.startswith("--upstream") for a in verify + draft + gateway)


def test_dtype_reaches_both_model_services_and_is_checked():
    p = plan("--model-path", "T", "--draft-model", "D", "--dtype", "bfloat16")
    assert values(verify_argv(p), "--dtype") == values(draft_argv(p, "v:1", ["v:1"]), "--dtype") == ["bfloat16"]
    assert values(verify_argv(plan("--model-path", "T", "--draft-model", "D")), "--dtype") == ["auto"]
    with pytest.raises(SystemExit):
        plan("--model-path", "T", "--draft-model", "D", "--dtype", "int8")


def test_kv_cache_dtype_reaches_the_verify_service_only_and_is_checked():
    """vLLM's and SGLang's --kv-cache-dtype: the target's KV (the verify service's config); the draft keeps its
    model's; names neither takes are refused."""
    from draft_service.__main__ import parse_args as draft_args
    from verify_service.__main__ import parse_args as verify_args

    p = plan("--model-path", "T", "--draft-model", "D", "--kv-cache-dtype", "bf16")
    assert verify_args(verify_argv(p))[0].kv_cache_dtype == "bf16"
    assert "--kv-cache-dtype" not in draft_argv(p, "v:1", ["v:1"])
    draft_args(draft_argv(p, "v:1", ["v:1"]))  # parses: nothing of the target's cache reaches it
    assert verify_args(verify_argv(plan("--model-path", "T", "--draft-model", "D")))[0].kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        plan("--model-path", "T", "--draft-model", "D", "--kv-cache-dtype", "fp8")


def test_cuda_graph_flags_reach_both_model_services_as_configs():
    """SGLang's --cuda-graph-max-bs / --disable-cuda-graph: parsed by each model service into its runner's
    bound; a draft without a model (suffix) gets none; a negative bound is refused."""
    from draft_service.__main__ import parse_args as draft_args
    from verify_service.__main__ import parse_args as verify_args

    p = plan("--model-path", "T", "--draft-model", "D", "--cuda-graph-max-bs", "8")
    verify, draft = verify_args(verify_argv(p))[0], draft_args(draft_argv(p, "v:1", ["v:1"]))[0]
    assert verify.graph_max_bs == draft.graph_max_bs == 8
    p = plan("--model-path", "T", "--draft-model", "D", "--disable-cuda-graph")
    verify, draft = verify_args(verify_argv(p))[0], draft_args(draft_argv(p, "v:1", ["v:1"]))[0]
    assert verify.graph_max_bs == draft.graph_max_bs == 0
    default = plan("--model-path", "T", "--draft-model", "D")
    assert verify_args(verify_argv(default))[0].graph_max_bs == 32
    suffix = plan("--model-path", "T", "--speculative-algorithm", "suffix", "--cuda-graph-max-bs", "8")
    assert "--cuda-graph-max-bs" not in draft_argv(suffix, "v:1", ["v:1"])
    with pytest.raises(UsageError, match="--cuda-graph-max-bs -1"):
        plan("--model-path", "T", "--draft-model", "D", "--cuda-graph-max-bs", "-1")


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


def test_tls_and_the_service_key_reach_every_service(tmp_path, monkeypatch):
    """`serve`'s --tls-* and --service-key-file reach each service under the names it takes them by (as
    docker-compose.tls.yml sets them), and each service's own parser reads them back."""
    import trustme

    from draft_service.__main__ import parse_args as draft_args
    from gateway.__main__ import parse_args as gateway_args
    from specmesh.security import Security, TLSConfig
    from verify_service.__main__ import parse_args as verify_args

    for key in [k for k in os.environ if k.startswith("SPECMESH_")]:
        monkeypatch.delenv(key)
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    issued = ca.issue_cert("specmesh-internal", "127.0.0.1")
    issued.cert_chain_pems[0].write_to_path(tmp_path / "cert.pem")
    issued.private_key_pem.write_to_path(tmp_path / "cert.key")
    (tmp_path / "service-key").write_text("svc-key\n")
    cert, key, ca_file, service_key = (str(tmp_path / n) for n in ("cert.pem", "cert.key", "ca.pem", "service-key"))
    p = plan(
        "--model-path", "T", "--draft-model", "D", "--device", "cpu", "--tls-cert", cert, "--tls-key", key,
        "--tls-ca", ca_file, "--tls-client-auth", "--tls-server-name", "specmesh-internal",
        "--service-key-file", service_key,
    )  # fmt: skip
    internal = TLSConfig(cert, key, ca_file, client_auth=True)
    _, verify = verify_args(verify_argv(p))
    assert Security.from_flags(verify).tls == internal and Security.from_flags(verify).key == "svc-key"
    _, draft = draft_args(draft_argv(p, "127.0.0.1:1", ["127.0.0.1:1"]))
    assert Security.from_flags(draft).tls == TLSConfig(cert, key, ca_file, True, "specmesh-internal")
    _, gateway = gateway_args(gateway_argv(p, ["127.0.0.1:1"], ["127.0.0.1:2"]))
    assert gateway.front.tls == TLSConfig(cert, key, ca_file)  # HTTPS; client certificates by --gateway-arg
    assert gateway.upstream.tls == TLSConfig(cert, key, ca_file, False, "specmesh-internal", "--upstream-tls")
    assert gateway.upstream.key == "svc-key"
    assert p.scheme == "https"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tls-cert", "/nope.pem", "--tls-key", "/nope.key"], "--tls-cert '/nope.pem': cannot read it"),
        (["--tls-ca", "/nope.pem"], "--tls-ca without --tls-cert"),
    ],
)
def test_tls_mistakes_are_one_line_before_anything_starts(args, message, capsys):
    from specmesh.stack import LaunchError, preflight

    p = plan("--model-path", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"), "--port", "0", *args)
    with pytest.raises(LaunchError, match=re.escape(message)):
        preflight(p)
