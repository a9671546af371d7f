"""Generated protobuf and gRPC modules for protos/scd/v1 (package scd.v1).

The modules under shared/pb/scd/v1/ are written by `make proto` and never edited by hand.
"""

try:
    from shared.pb.scd.v1 import common_pb2, consumer_pb2, consumer_pb2_grpc, producer_pb2, producer_pb2_grpc
except ImportError as exc:  # pragma: no cover - only without generated code
    raise ImportError("generated protobuf code is missing: run `make proto`") from exc

__all__ = ["common_pb2", "consumer_pb2", "consumer_pb2_grpc", "producer_pb2", "producer_pb2_grpc"]
