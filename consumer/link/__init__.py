"""The producer link, the consumer's side of the wire: the gRPC client of the Prefill stream
(producer_client.py), the stream contract it enforces (stream_reader.py), the link's
readiness and compatibility checks (readiness.py, compat.py), and the names a context's KV
goes by in the prefix cache and in the producer's store (prefix_keys.py).

May import: consumer/engine/, shared.
"""
