"""One mechanism alone, each `python -m bench.micro.<name>`: the gRPC stream against a socket
(transport.py), the floor of a gRPC call in Python (grpc_floor.py), the engine's step against
the bare model's (engine_step.py), CPU per log line (log_cost.py) and per batched rebuild
(rebuild_cost.py).

May import: bench/harness/, shared, producer, consumer, qa.
"""
