"""The standard gRPC services every specmesh server carries, completed where grpcio's packages stop short.

- Health: grpcio-health-checking's servicer answers Check and Watch but not `List` (added to
  grpc.health.v1 later; the generated stub routes it to a default that answers UNIMPLEMENTED and logs a
  traceback). `Health.List` here returns every registered service with its status.
- Reflection: grpcio-reflection serves `grpc.reflection.v1alpha.ServerReflection` only, while current
  clients (grpcurl, Postman, grpcui) ask for `grpc.reflection.v1.ServerReflection` first. v1 is the same
  protocol under the stable package name, message for message and field for field, so the v1 service here
  is v1alpha's descriptor renamed and added to the descriptor pool, answered by the same servicer.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_V1ALPHA = reflection.SERVICE_NAME
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class Health(HealthServicer):
    """grpc.health.v1.Health with List."""

    async def List(self, request, context) -> health_pb2.HealthListResponse:
        # `_server_status` is the servicer's own table (service -> status) that Check reads; List is a
        # snapshot of it, as the proto specifies.
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in dict(self._server_status).items()
            }
        )


def _rename(proto: descriptor_pb2.DescriptorProto, old: str, new: str) -> None:
    for field in proto.field:
        if field.type_name.startswith(old):
            field.type_name = new + field.type_name[len(old) :]
    for nested in proto.nested_type:
        _rename(nested, old, new)


def _reflection_v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto under the name and package of grpc/reflection/v1/reflection.proto."""
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    fdp.ClearField("options")
    for message in fdp.message_type:
        _rename(message, old, new)
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new)
            method.output_type = method.output_type.replace(old, new)
    return fdp


def _add_reflection_v1_file() -> None:
    """Put grpc/reflection/v1/reflection.proto in the default pool, so reflection can describe itself."""
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName("grpc/reflection/v1/reflection.proto")
    except KeyError:  # not there yet (another package may have added the real file: same content)
        pool.Add(_reflection_v1_file())


def add_standard_services(server: grpc.aio.Server, service_names: list[str]) -> Health:
    """Health (with List) and reflection v1 + v1alpha on `server`, listing `service_names` and themselves."""
    health = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    names = [*service_names, HEALTH_SERVICE, REFLECTION_V1, REFLECTION_V1ALPHA]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection.enable_server_reflection(names, server)  # v1alpha, grpcio-reflection's own registration
    _add_reflection_v1_file()
    # v1 and v1alpha messages share every field number: v1alpha's classes read and write v1's bytes.
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )
    return health
