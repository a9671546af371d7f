"""One request as the parts pass it along: what to do and what it reports (job.py), its
transfer into its KV blocks (transfer.py), its engine task as an async stream
(engine_stream.py), the decode loop every answer streams through (decode.py) and where an
answer ends (ending.py): the steps the exact-answer policies and the pipeline both take.

May import: consumer/auto/, consumer/link/, consumer/engine/, shared.
"""
