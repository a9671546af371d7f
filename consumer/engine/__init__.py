"""The batch engine: one thread owns the compute device; each iteration runs the queued jobs,
one prefill forward and one decode forward over every admitted request (batch.py), over one
preallocated KV pool (kv_pool.py) that admission reserves from (kv_admission.py), with the
model runner (runner.py), the prefix cache's chunks inside the pool (prefix_cache.py), sampling
and detokenization (decoding.py), what a draft keeps for verified decoding's acceptance
(speculative.py), and the engine in a process of its own (process.py).

May import: shared. Knows no request type, transfer, policy or gRPC (consumer/__init__.py).
"""
