"""Demo and benchmarks: real services in subprocesses, driven over gRPC, printing JSON lines."""
