"""Our own forward for the Llama family this project serves (Llama, Qwen2, Qwen3): geometry from
the config (config.py), RoPE (rope.py), fused weights taken from the loaded checkpoint
(weights.py) and the decoder over flat token rows with caller-supplied attention (model.py).

May import torch and shared.models' types only; never the services, codecs, engine or gRPC.
Hugging Face's modules are the reference it is tested against (tests/test_model_forward.py).
"""

from shared.model.model import EAGER, Attend, Model, Ops, causal, masked, of
from shared.model.packed import Packed

__all__ = ["EAGER", "Attend", "Model", "Ops", "Packed", "causal", "masked", "of"]
