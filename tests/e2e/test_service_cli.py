"""The services as users run them: `python -m verify_service` / `python -m draft_service` subprocesses,
flags from the environment, health, reflection, and a graceful SIGTERM that lets in-flight work finish."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from tests.support.services import generate, save_tiny_checkpoints, spawn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return save_tiny_checkpoints(tmp_path_factory.mktemp("ckpt"))


def health(address: str, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.fixture(scope="module")
def processes(checkpoints):
    target, draft = checkpoints
    verify, vaddr = spawn(
        "verify_service",
        ["--model-path", str(target)],
        {"SPECMESH_VERIFY_MAX_BATCH_SIZE": "3", "SPECMESH_VERIFY_GRACE_PERIOD_S": "30"},
    )
    drafts, daddr = spawn("draft_service", ["--model-path", str(draft)], {"SPECMESH_DRAFT_VERIFY_ADDRESS": vaddr})
    yield (verify, vaddr), (drafts, daddr)
    for p in (drafts, verify):
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_cli_help_names_every_env_variable():
    out = subprocess.run(
        [sys.executable, "-m", "verify_service", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    for flag in ("--model-path", "--max-batch-size", "--draft-deadline-ms", "--kv-cache-budget-mb"):
        assert flag in out
    assert "SPECMESH_VERIFY_MAX_BATCH_SIZE" in out
    out = subprocess.run(
        [sys.executable, "-m", "draft_service", "--help"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "--speculative-algorithm" in out and "SPECMESH_DRAFT_SPECULATIVE_NUM_STEPS" in out
    bad = subprocess.run(
        [sys.executable, "-m", "draft_service", "--speculative-algorithm", "eagle"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_health_reflection_and_env_flags(processes):
    (_, vaddr), (_, daddr) = processes
    for addr, service in ((vaddr, "specmesh.v1.VerifyService"), (daddr, "specmesh.v1.DraftService")):
        assert health(addr) == health_pb2.HealthCheckResponse.SERVING
        assert health(addr, service) == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(addr)).get_services()
        assert service in services and "grpc.health.v1.Health" in services
    info = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(vaddr)).Info(verify_pb2.VerifyServiceInfoRequest())
    assert info.max_batch_size == 3  # from SPECMESH_VERIFY_MAX_BATCH_SIZE
    dinfo = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(daddr)).Info(draft_pb2.DraftServiceInfoRequest())
    assert dinfo.default_verify_address == vaddr  # from SPECMESH_DRAFT_VERIFY_ADDRESS


def test_greedy_with_stop_string_matches_in_process(processes, checkpoints):
    (_, _), (_, daddr) = processes
    engine = SpeculativeEngine.from_paths(*checkpoints, device="cpu")
    prompt = engine.tokenizer.encode("def main():\n")
    reference = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40), 0)
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(daddr))
    tokens, chunks = generate(stub, prompt, common_pb2.SamplingParams(temperature=0.0, max_tokens=40))
    assert tokens == reference.token_ids
    # a stop string taken from the reference text ends the generation early, applied by the verifier
    text = engine.tokenizer.decode(reference.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        want = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=(stop,)), 0)
        got, chunks = generate(stub, prompt, common_pb2.SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]))
        assert got == want.token_ids and chunks[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP


def test_sigterm_drains_in_flight_work(processes):
    (verify, vaddr), (_, daddr) = processes
    stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(daddr))
    started = threading.Event()
    result = {}

    def run():
        chunks = []
        try:
            for c in stub.Generate(
                draft_pb2.DraftServiceGenerateRequest(
                    prompt_ids=[5, 6, 7],
                    params=common_pb2.SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True),
                ),
                timeout=120,
            ):
                chunks.append(c)
                if len(chunks) > 2:
                    started.set()
        except grpc.RpcError as e:
            result["error"] = e
        result["chunks"] = chunks

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(60)
    verify.send_signal(signal.SIGTERM)
    states = set()
    for _ in range(100):
        try:
            states.add(health(vaddr))
        except grpc.RpcError:
            break
        if health_pb2.HealthCheckResponse.NOT_SERVING in states:
            break
        time.sleep(0.02)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in states
    with pytest.raises(grpc.RpcError) as e:  # no new work while draining
        verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(vaddr)).OpenSession(
            verify_pb2.OpenSessionRequest(prompt_ids=[1, 2]), timeout=5
        )
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    t.join(120)
    assert "error" not in result, result.get("error")
    assert result["chunks"][-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(c.tokens.token_ids) for c in result["chunks"]) == 600  # the in-flight generation finished
    assert verify.wait(60) == 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--block-size", "24"], "--block-size: block_size must be a power of two in [1, 256], not 24"),
        # the demo target's whole context (2,048 tokens) takes 80 MiB of KV in fp32: 10 MiB holds 256 tokens
        (["--kv-cache-budget-mb", "10"], "fewer than one sequence of max_model_len 2048: raise --kv-cache-budget-mb"),
        # vLLM's fp8 caches are not kept here; bfloat16 is the paged runner's, under a float32 model
        (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8'"),
        (["--kv-cache-dtype", "bf16", "--runner", "batched"], "--kv-cache-dtype bf16: only the paged runner"),
        (["--kv-cache-dtype", "bfloat16", "--dtype", "float16"], "--kv-cache-dtype bfloat16 with a torch.float16"),
    ],
)
def test_bad_kv_settings_are_a_clear_error_at_start_and_exit_2(args, message):
    target = ROOT / "models" / "demo" / "target"
    bad = subprocess.run(
        [sys.executable, "-m", "verify_service", "--model-path", str(target), "--port", "0", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert message in bad.stderr and "Traceback" not in bad.stderr
