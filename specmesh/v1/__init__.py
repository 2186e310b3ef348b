"""Generated protobuf / gRPC code of the specmesh.v1 contract (`proto/specmesh/v1`). Do not edit:
run `make proto` (python -m specmesh.codegen); tests/test_proto.py fails when these files are stale."""
