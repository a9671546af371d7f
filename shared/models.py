"""Loading a causal LM for serving, and what both services need to know about it.

Owns: device resolution, applying the compute dtype (`--dtype auto` is chosen by
`shared.compute_dtype`; weights are cast to it at load, bf16 checkpoints upcast),
`from_pretrained` on a path or hub id (or a builtin tiny name), the dtype-independent weight
digest, warm-up, and the `LoadedModel` handle with the model's layer geometry. Knows nothing
about gRPC or codecs.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from shared import compute_dtype, logs, pretrained, tiny

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logs.get("models")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    weight_digest: str
    architecture: str
    dtype: str
    device: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype_reason: str = ""  # why `dtype` computes (shared.compute_dtype.choose), e.g. "--dtype auto: ...: float32"
    origin: str = ""  # where the weights came from, for a registry model (shared.pretrained.origin), else ""

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of the full K and V cache for `tokens` tokens in this model's dtype."""
        element = torch.finfo(DTYPES[self.dtype]).bits // 8
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * tokens * element


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo

    @functools.cached_property
    def device(self) -> torch.device:
        """The model's device, read once (transformers' `model.device` walks the parameters)."""
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_path(model_id: str) -> str:
    """A builtin tiny name or a registry model's short name (shared.pretrained) becomes its
    (built-on-demand) directory; anything else is passed on."""
    if model_id in tiny.BUILTIN and not Path(model_id).exists():
        return str(tiny.ensure_tiny(model_id))
    if model_id in pretrained.NAMES and not Path(model_id).exists():
        return str(pretrained.ensure(model_id))
    return model_id


def weight_digest(model: torch.nn.Module) -> str:
    """SHA-256 over (name, shape, bytes in bfloat16) of every tensor in name order.

    Hashing the bf16 rounding makes the digest the same whether the checkpoint was loaded in
    float32, bfloat16 or float16-from-bf16, so artifacts match the model, not the load dtype.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode())
        flat = tensor.detach().to("cpu", torch.bfloat16).contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_model(model_id: str, dtype: str = "float32", device: str = "auto") -> LoadedModel:
    """`dtype` is one of DTYPES or "auto" (bfloat16 where the device computes it natively, else
    float32: shared.compute_dtype); an explicit bfloat16 the device emulates logs a warning."""
    if dtype not in DTYPES and dtype != compute_dtype.AUTO:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)} or {compute_dtype.AUTO!r}")
    target = resolve_device(device)
    choice = compute_dtype.resolve(dtype, target)  # auto/bfloat16: the device's facts (CPU: a probe, milliseconds)
    if choice.warning:
        log.warning("model.dtype_slow", dtype=choice.dtype, device=str(target), warning=choice.warning)
    dtype = choice.dtype
    path = resolve_path(model_id)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    cast(torch.nn.Module, model).to(target).eval()  # transformers' decorated `to` stub rejects a device
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    info = ModelInfo(
        model_id=model_id,
        weight_digest=weight_digest(model),
        architecture=type(model).__name__,
        dtype=dtype,
        device=str(target),
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        dtype_reason=choice.reason,
        origin=pretrained.origin(path),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


@torch.inference_mode()
def warm_up(loaded: LoadedModel, tokens: int = 16) -> None:
    """One short forward so the first request does not pay for lazy initialization."""
    ids = torch.arange(tokens, device=loaded.device).remainder(loaded.info.vocab_size)[None]
    loaded.model(ids)
