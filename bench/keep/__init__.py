"""Token selection (shared.keep) checked against its reference implementation (NVIDIA kvpress)."""
