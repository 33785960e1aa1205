"""Serves gRPC server reflection under its v1 name as well as v1alpha.

grpcio-reflection only ships `grpc.reflection.v1alpha.ServerReflection`, while newer tools
(grpcurl, Postman, grpc-java's and grpc-go's reflection clients) ask for
`grpc.reflection.v1.ServerReflection` first. The two protocols are the same messages under
another package name (grpc/grpc-proto's reflection/v1/reflection.proto), so the v1alpha
servicer answers both: this module registers it under the v1 path with the v1alpha
message classes as (de)serializers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as _messages
from grpc_reflection.v1alpha._async import ReflectionServicer

SERVICE_NAME_V1 = "grpc.reflection.v1.ServerReflection"


def enable(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Registers reflection v1alpha and v1 on server, listing service_names and both."""
    listed = [*service_names, reflection.SERVICE_NAME, SERVICE_NAME_V1]
    servicer = ReflectionServicer(listed)
    reflection.enable_server_reflection(listed, server)
    handler: grpc.RpcMethodHandler[Any, Any] = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=_messages.ServerReflectionRequest.FromString,
        response_serializer=_messages.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME_V1, {"ServerReflectionInfo": handler}),)
    )
