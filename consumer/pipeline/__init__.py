"""The request pipeline, the same for every codec: KV memory, prefix cache, transfer or own
prefill, the exact-answer policies, decode (pipeline.py); and what a finished request teaches
mode auto (learning.py).

May import: consumer/exact/, consumer/request/, consumer/auto/, consumer/link/, consumer/engine/, shared.
"""
