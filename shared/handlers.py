"""Registering a servicer on a grpc.aio server from its service descriptor, with request
deserializers that never fail and stream responses that may be pre-serialized bytes: undecodable request bytes become INVALID_ARGUMENT naming the
message type (the generated `add_..._to_server` would answer UNKNOWN with the parser's text).

Knows nothing about the services' logic; used by both servers instead of the generated helper.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor


@dataclass(frozen=True)
class Undecodable:
    """Stands in for a request whose bytes did not parse."""

    type_name: str
    size: int


def _deserializer(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (pb_message.DecodeError, RuntimeError, ValueError):
            return Undecodable(cls.DESCRIPTOR.full_name, len(data))

    return parse


def _serializer(cls):
    """Messages are serialized; bytes (a message serialized once, ahead: the producer's layers)
    pass through untouched."""
    serialize = cls.SerializeToString

    def write(message) -> bytes:
        return message if isinstance(message, bytes) else serialize(message)

    return write


def _refusal(request: Undecodable) -> str:
    return f"request: {request.size} bytes do not parse as {request.type_name}"


def add_servicer(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        impl = getattr(servicer, method.name)
        if method.client_streaming:
            raise NotImplementedError(f"{method.full_name}: client streaming is not used in scd.v1")
        if method.server_streaming:

            async def stream(request, context, impl=impl):
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(request))
                async for item in impl(request, context):
                    yield item

            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                stream, request_deserializer=_deserializer(request_cls), response_serializer=_serializer(response_cls)
            )
        else:

            async def unary(request, context, impl=impl):
                if isinstance(request, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(request))
                return await impl(request, context)

            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=_deserializer(request_cls), response_serializer=response_cls.SerializeToString
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
