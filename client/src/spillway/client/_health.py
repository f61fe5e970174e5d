"""The two ``grpc.health.v1`` messages, built in a private descriptor pool.

The client's install is only grpcio, protobuf and opentelemetry-api, so it cannot rely on
grpcio-health-checking; a private pool also never clashes with that package's registration.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"

_F = descriptor_pb2.FieldDescriptorProto


def _build():
    fdp = descriptor_pb2.FileDescriptorProto(
        name="spillway/client/health.proto", package="grpc.health.v1", syntax="proto3")
    req = fdp.message_type.add(name="HealthCheckRequest")
    req.field.add(name="service", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    resp = fdp.message_type.add(name="HealthCheckResponse")
    status = resp.enum_type.add(name="ServingStatus")
    for number, name in enumerate(("UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN")):
        status.value.add(name=name, number=number)
    resp.field.add(name="status", number=1, type=_F.TYPE_ENUM, label=_F.LABEL_OPTIONAL,
                   type_name=".grpc.health.v1.HealthCheckResponse.ServingStatus")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    # GetMessageClass exists from protobuf 4.22; the client declares protobuf>=3.20.3, where
    # MessageFactory.GetPrototype (removed in protobuf 5) is the way.
    get_class = getattr(message_factory, "GetMessageClass", None) \
        or message_factory.MessageFactory(pool).GetPrototype
    return (
        get_class(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckRequest")),
        get_class(pool.FindMessageTypeByName("grpc.health.v1.HealthCheckResponse")),
    )


HealthCheckRequest, HealthCheckResponse = _build()


def status_name(response) -> str:
    return HealthCheckResponse.DESCRIPTOR.enum_types_by_name["ServingStatus"] \
        .values_by_number[response.status].name
