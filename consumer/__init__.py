"""The consumer service: rebuild the context's KV from the producer's stream, decode, stream tokens.

Its parts, one package each, lowest first: a module imports its own part or one listed above it
here, never one below (tests/test_consumer_parts.py reads every import against this list):

    engine/    the batch engine: KV pool, admission by KV memory, runner, scheduler, prefix cache,
               sampling and detokenization, the engine process; knows no request type, transfer or gRPC
    link/      the producer link: its gRPC client, the stream contract, readiness and compatibility,
               the names of a context's KV (prefix keys)
    auto/      mode auto: the planner's estimates, the chooser, what the producer holds, background
               probes, the default mode
    request/   one request: its job and result types, its transfer into its blocks, its engine task
               as an async stream, its decode loop and ending (the steps the policies and the
               pipeline share)
    exact/     the exact-answer policies over a rebuilt cache: audit, verified decoding, repair
    pipeline/  the request pipeline (admission, transfer, policies, decode) and what a finished
               request teaches auto
    api/       the fronts: the gRPC servicer, the OpenAI HTTP port and its schema, request
               validation (job_builder), the stream's messages; and the client of the service
    server.py  the composition root: builds the parts and wires both fronts (`python -m consumer`)
"""
