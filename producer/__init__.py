"""The producer service: prefill on the producer model, stream encoded layers (scd.v1)."""
