"""The consumer service: rebuild the context's KV from the producer's stream, decode, stream tokens."""
