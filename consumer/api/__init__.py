"""The consumer's fronts. gRPC: the servicer (servicer.py), a GenerateRequest's validation into
a job (job_builder.py), the stream's and Describe's messages (messages.py). HTTP: the
OpenAI-compatible app (openai_api.py) with its requests in (openai_schema.py, openai_chat.py)
and responses out (openai_reply.py). And the client of the service (client.py). The two fronts
do not import each other: consumer/server.py wires them onto one servicer.

May import: every consumer part below it (consumer/__init__.py), shared.
"""
