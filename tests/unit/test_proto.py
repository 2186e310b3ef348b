"""The contract: committed generated code equals what the pinned protoc generates from proto/ today, every
field is documented, and the shapes buf's STANDARD lint asks for hold even where buf is not installed."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from specmesh import codegen
from specmesh.v1 import draft_pb2, gateway_pb2, verify_pb2

SERVICE_MODULES = (draft_pb2, gateway_pb2, verify_pb2)


def _methods():
    for module in SERVICE_MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                yield service, method


def test_generated_stubs_are_not_stale(tmp_path: Path):
    fresh = codegen.generate(tmp_path)
    committed = codegen.ROOT / "specmesh" / "v1"
    names = sorted(p.name for p in fresh)
    assert names == sorted(p.name for p in committed.glob("*_pb2*.py*")), "run `make proto`"
    for p in fresh:
        assert p.read_bytes() == (committed / p.name).read_bytes(), f"{p.name} is stale: run `make proto`"
    assert len(names) == 3 * len(codegen.proto_files())


def test_contract_is_versioned_and_documented():
    for proto in codegen.proto_files():
        text = proto.read_text()
        assert "package specmesh.v1;" in text
        lines = text.splitlines()
        # every field line carries a comment, on the line or just above it
        for i, line in enumerate(lines):
            s = line.strip()
            if s and "=" in s and s.endswith(";") and not s.startswith(("//", "syntax", "package", "option")):
                assert "//" in s or lines[i - 1].strip().startswith("//") or "FINISH_REASON" in s, (
                    f"{proto.name}:{i + 1} undocumented: {s}"
                )


def test_every_rpc_has_its_own_standard_request_and_response():
    seen = {}
    for service, method in _methods():
        for suffix, message in (("Request", method.input_type), ("Response", method.output_type)):
            assert message.name in (f"{method.name}{suffix}", f"{service.name}{method.name}{suffix}"), (
                f"{service.name}.{method.name}: {message.name}"
            )
            assert message.full_name not in seen, f"{message.full_name} serves {seen.get(message.full_name)} too"
            seen[message.full_name] = f"{service.name}.{method.name}"


def test_streamed_generations_say_their_chunk_kind_in_a_oneof():
    for service, method in _methods():
        if method.server_streaming and method.name != "Verify":  # a verdict stream has one kind of message
            assert list(method.output_type.oneofs_by_name) == ["chunk"], f"{service.name}.{method.name}"
            kinds = [f.name for f in method.output_type.oneofs_by_name["chunk"].fields]
            assert kinds[-1] == "finished", f"{service.name}.{method.name}: {kinds}"


def test_packing_is_left_to_the_proto3_default():
    for proto in codegen.proto_files():
        for line in proto.read_text().splitlines():
            if not line.strip().startswith("//"):
                assert "packed" not in line, f"{proto.name}: {line.strip()}"


def test_the_gateway_requests_are_the_same_on_the_wire():
    def shape(message):
        return [
            (f.name, f.number, f.type, f.is_repeated, f.message_type and f.message_type.full_name)
            for f in message.DESCRIPTOR.fields
        ]

    assert shape(gateway_pb2.GatewayServiceGenerateRequest) == shape(gateway_pb2.GatewayServiceGenerateStreamRequest)


def test_the_light_client_ships_the_same_fresh_stubs(tmp_path: Path):
    """clients/python's wheel takes specmesh.v1 from the checkout: built here, its stubs are byte for byte
    what protoc generates from proto/ today, and nothing of the server comes with them."""
    client = codegen.ROOT / "clients" / "python"
    # pip builds in the tree: a build/ left by an earlier build would bring back files removed since
    shutil.rmtree(client / "build", ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path / "w", client],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "w").glob("specmesh_client-*.whl")
    fresh = {p.name: p.read_bytes() for p in codegen.generate(tmp_path / "gen")}
    with zipfile.ZipFile(wheel) as z:
        shipped = {n: z.read(n) for n in z.namelist() if not n.startswith("specmesh_client")}
        shipped = {n: b for n, b in shipped.items() if ".dist-info/" not in n}
    assert {n.removeprefix("specmesh/v1/") for n in shipped} == {*fresh, "__init__.py"}
    for name, data in fresh.items():
        assert shipped[f"specmesh/v1/{name}"] == data, f"the client's {name} is stale"
