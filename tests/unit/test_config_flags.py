"""Flags generated from config dataclasses (specmesh.config): each service's flags come from its config's fields,
and `flags.to_argv` renders a config back to the flags that give it back."""

import os
from dataclasses import fields

import pytest

from draft_service.__main__ import parse_args as draft_args
from draft_service.engine import DraftConfig
from gateway.__main__ import GatewayProcess
from gateway.__main__ import parse_args as gateway_args
from gateway.config import GatewayConfig
from specmesh import config as flags
from verify_service.__main__ import parse_args as verify_args
from verify_service.engine import VerifyConfig


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Defaults are the code's, not whatever SPECMESH_* variable the machine has set."""
    for key in list(os.environ):
        if key.startswith("SPECMESH_"):
            monkeypatch.delenv(key)


def flag_names(config_type) -> set[str]:
    return {f.name for f in flags.flag_fields(config_type)}


def flag_values(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in flags.flag_fields(obj)}


@pytest.mark.parametrize(
    "parse, argv",
    [
        (verify_args, ["--model-path", "m"]),
        (verify_args, ["--model-path", "m", "--max-batch-size", "5", "--no-kv-cache-prefault", "--seed", "7",
                       "--runner", "hf", "--batch-wait-ms", "0.5", "--metrics-port", "-1", "--device", "cpu"]),
        (draft_args, ["--speculative-algorithm", "NGRAM", "--no-pipeline", "--verify-allow", "10.0.0.0/8:*",
                      "--online-distill-lr", "0.001", "--port", "0"]),
        (gateway_args, ["--verify", "a:1, b:2", "--draft", "c:3", "--tokenizer-path", "/models/tok",
                        "--max-queue", "9", "--load-factor", "2", "--port", "8080", "--no-open-health",
                        "--log-format", "json"]),
        (gateway_args, ["--verify", "a:1", "--model-name", "m", "--grpc-port", "-1"]),
    ],
)  # fmt: skip
def test_to_argv_round_trips_every_service_config(parse, argv):
    config, process = parse(argv)
    rendered = flags.to_argv(config) + (flags.to_argv(process) if isinstance(process, GatewayProcess) else [])
    again, process_again = parse(rendered)
    assert again == config
    if isinstance(process, GatewayProcess):
        assert flag_values(process_again) == flag_values(process)


def test_to_argv_leaves_out_defaults_and_renders_each_kind():
    config, _ = verify_args(["--model-path", "m"])
    assert flags.to_argv(config) == ["--model-path", "m"]
    # A flag's own default is what parsing gives without it: code that builds a VerifyConfig serves no metrics
    # (-1), the command line's default serves them on 9464.
    assert flags.to_argv(VerifyConfig(model_path="m", max_batch_size=4)) == [
        "--model-path", "m", "--max-batch-size", "4", "--metrics-port", "-1",
    ]  # fmt: skip
    assert flags.to_argv(GatewayConfig(verify=("a:1", "b:2"), model_name="")) == ["--verify", "a:1,b:2"]
    assert flags.to_argv(flags.Logging(log_format="json")) == ["--log-format", "json"]
    # a mapping (some fields of a config a launcher cannot import): every value but None, booleans both ways
    assert flags.to_argv({"pipeline": False, "adaptive": True, "seed": None, "verify": ("a", "b"), "port": 0}) == [
        "--no-pipeline", "--adaptive", "--verify", "a,b", "--port", "0",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--log-level"):
        flags.to_argv(flags.Logging(log_level=None))  # nothing on a command line parses to None


def test_every_flag_is_declared_by_a_field_with_help():
    for config_type in (VerifyConfig, DraftConfig, GatewayConfig, GatewayProcess):
        for f in flags.flag_fields(config_type):
            assert f.metadata[flags.FLAG].help, f"{config_type.__name__}.{f.name}"
    assert {f.name for f in fields(VerifyConfig)} - flag_names(VerifyConfig) == {"attached_wait_s"}
    assert {f.name for f in fields(GatewayConfig)} - flag_names(GatewayConfig) == {"tokenizer_threads"}
    # The gateway's listen flags are the ones `specmesh serve` declares: one declaration, taken by both.
    assert flag_names(flags.GatewayListen) <= flag_names(GatewayProcess)


def test_environment_then_command_line(monkeypatch):
    monkeypatch.setenv("SPECMESH_VERIFY_MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("SPECMESH_VERIFY_KV_CACHE_PREFAULT", "false")
    config, process = verify_args(["--model-path", "m", "--threads", "2"])
    assert (config.max_batch_size, config.kv_cache_prefault, process["threads"]) == (3, False, 2)
    assert verify_args(["--model-path", "m", "--max-batch-size", "9"])[0].max_batch_size == 9
    monkeypatch.setenv("SPECMESH_GATEWAY_VERIFY", "a:1,b:2")  # a required flag the environment gives
    assert gateway_args([])[0].verify == ("a:1", "b:2")


def test_a_config_that_refuses_its_values_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        verify_args(["--model-path", "m", "--max-spec-len", "0"])
    assert exit_.value.code == 2 and "max_spec_len must be in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gateway_args(["--verify", "a:1", "--speculative-num-steps", "99"])
    assert "--speculative-num-steps must be in" in capsys.readouterr().err


def test_process_flags_stay_out_of_the_config():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Config:
        size: int = flags.option(2, "how many")
        name: str = flags.option("x", "what", choices=("x", "y"))

    ap = flags.EnvArgumentParser(prog="t", env_prefix=None)
    flags.add_config_flags(ap, Config)
    with ap.process_flags():
        flags.add_config_flags(ap, flags.Logging)
    config, process = flags.parse_config(ap, Config, ["--size", "3", "--log-level", "DEBUG"])
    assert config == Config(size=3) and process == {"log_level": "DEBUG", "log_format": "text"}
    assert "[env" not in ap.format_help()  # no environment without a prefix
