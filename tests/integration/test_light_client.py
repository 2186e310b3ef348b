"""The light client (clients/python, `specmesh-client`) in a clean virtual environment without the serving
stack: installed with pip from the checkout, it imports without torch, triton or transformers and talks
to a real gateway on loopback.

The environment is cached under .work/ keyed by the hash of the client's pyproject.toml (its
dependencies, fetched from the package index once); the client itself is reinstalled from the checkout
on every run, so what is tested is always today's code and stubs.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.models import ROOT

CLIENT = ROOT / "clients" / "python"

pytestmark = pytest.mark.slow

# Run inside the clean environment: the typed client against the gateway given as argv[1].
SCRIPT = r"""
import importlib.util, json, sys
from specmesh_client import SpecmeshClient
from specmesh.v1 import gateway_pb2  # the raw stubs come with it

with SpecmeshClient(sys.argv[1], model="demo") as client:
    whole = client.generate(
        messages=[{"role": "user", "content": "A loop, please."}], max_tokens=8, temperature=0, session_id="light"
    )
    chunks = list(client.generate_stream("import os\n", max_tokens=8, temperature=0))
print(json.dumps({
    "absent": [m for m in ("torch", "triton", "transformers") if importlib.util.find_spec(m) is None],
    "whole": [whole.text, list(whole.token_ids), whole.finish_reason, whole.session_id],
    "stream": [[c.text, list(c.token_ids), c.finish_reason, c.session_id] for c in chunks],
    "stubs": gateway_pb2.__file__,
    "spec": [
        [m.num_spec_steps, m.num_accepted_draft_tokens, list(m.acceptance_histogram), m.mean_acceptance_length,
         s.drafts]
        for m, s in ((whole.speculative_decoding, whole.stats), (chunks[-1].speculative_decoding, chunks[-1].stats))
    ],
}))
"""


def _run(*cmd, timeout=300, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def venv() -> Path:
    key = hashlib.sha256((CLIENT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    path = ROOT / ".work" / f"client-venv-{key}"
    python = path / "bin" / "python"
    if not (path / ".ready").exists():
        shutil.rmtree(path, ignore_errors=True)
        # the venv module of the interpreter running the tests, without its site-packages (no torch)
        _run(sys.executable, "-m", "venv", path)
        # the client's dependencies (and setuptools, to build it from the checkout without an isolated
        # build environment on every run): the one step that needs the package index
        deps = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]["dependencies"]
        _run(python, "-m", "pip", "install", "-q", "setuptools>=68", *deps, timeout=600)
        (path / ".ready").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    shutil.rmtree(CLIENT / "build", ignore_errors=True)  # pip builds in the tree: no stale build/ files
    _run(
        python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--force-reinstall", CLIENT, env=env
    )
    return python


def test_light_client_in_a_clean_venv_calls_the_real_gateway(venv, demo_stack):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # outside the checkout, so nothing of the server's tree is importable from the working directory
    proc = subprocess.run(
        [venv, "-c", "import torch"], capture_output=True, text=True, cwd=venv.parents[1], env=env, timeout=60
    )
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr, proc.stderr
    out = _run(venv, "-c", SCRIPT, demo_stack.grpc_address, cwd=venv.parents[1], env=env).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["absent"] == ["torch", "triton", "transformers"]
    assert str(venv.parents[1]) in got["stubs"]  # the venv's own copy, not the checkout's

    # the same answers as the gateway gives the server's own stubs, in this process
    from specmesh_client import SpecmeshClient

    with SpecmeshClient(demo_stack.grpc_address) as here:
        whole = here.generate(
            messages=[{"role": "user", "content": "A loop, please."}], max_tokens=8, temperature=0, session_id="light"
        )
        stream = list(here.generate_stream("import os\n", max_tokens=8, temperature=0))
    assert got["whole"] == [whole.text, list(whole.token_ids), "length", "light"]
    assert len(whole.token_ids) == 8

    # The same output; where the chunks break depends on the speculation's rounds (K adapts to timing).
    def joined(chunks):
        return ["".join(c[0] for c in chunks), [t for c in chunks for t in c[1]], [c[2] for c in chunks if c[2]]]

    here_chunks = [[c.text, list(c.token_ids), c.finish_reason, c.session_id] for c in stream]
    assert joined(got["stream"]) == joined(here_chunks)
    assert got["stream"][-1][2] == "length" and sum(len(c[1]) for c in got["stream"]) == 8
    assert all(c[3] == "" for c in got["stream"] + here_chunks)
    # vLLM's per-request metrics, on the unary reply and the last chunk: the steps are the stats' drafts
    for steps, accepted, hist, mean, drafts in got["spec"]:
        assert steps == sum(hist) == drafts and accepted == sum(j * c for j, c in enumerate(hist))
        assert mean == (1 + accepted / steps if steps else 1.0)
