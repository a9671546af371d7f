"""Loading a causal LM for serving, and what both services need to know about it.

Owns: device resolution, applying the compute dtype (`--dtype auto` is chosen by
`shared.compute_dtype`; weights are cast to it at load, bf16 checkpoints upcast),
`from_pretrained` on a path or hub id (or a builtin tiny name) with the weights copied out of the
checkpoint's file map (`owned_weights`), the model's two names, warm-up,
and the `LoadedModel` handle with the model's layer geometry. Knows nothing about gRPC or codecs.

Two names, for two questions:
- `weight_digest` (the artifact digest): the weights rounded to bfloat16, dtype-blind, so one codec
  artifact matches one checkpoint served in float32 or bfloat16. Used only to match artifacts.
- `identity`: everything that shapes the K/V this process computes: the weights at their own
  precision (two float32 checkpoints that round to the same bfloat16 differ here), the config
  fields the forward reads (`config_digest`: rope_theta and rope scaling, sliding window, norm eps,
  head dims, ...) and the compute dtype. Chunk keys (shared.chunks), the stream header's
  ModelInfo.identity and the consumer's checks of KV it keeps or takes as exact use it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from shared import compute_dtype, kv_bound, logs, pretrained, tiny
from shared.model import of as forward_of

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
    identity: str = ""  # what shapes its K/V: weights at their precision, forward config, dtype (`model_identity`)
    origin: str = ""  # where the weights came from, for a registry model (shared.pretrained.origin), else ""

    @property
    def own_kv(self) -> tuple[str, str]:
        """(identity, dtype): what a stream header must name for its K/V to be this model's own
        (the identity names weights at their precision, forward config and dtype, so a producer of
        other rope settings or of a float32 checkpoint that rounds to the same bfloat16 is not)."""
        return self.identity, self.dtype

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

    @functools.cached_property
    def kv_bounds(self) -> tuple[kv_bound.LayerBound, ...]:
        """Per layer, the most its keys and values can hold (shared.kv_bound), from the weights, once."""
        info = self.info
        return kv_bound.layer_bounds(self.model, info.hidden_size, info.num_kv_heads, info.head_dim)

    @functools.cached_property
    def hidden_bounds(self) -> tuple[float, ...]:
        """Per layer, the most |element| of the residual stream entering it (shared.kv_bound), once."""
        return kv_bound.hidden_bounds(self.model, self.info.hidden_size)


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


def weight_digests(model: torch.nn.Module) -> tuple[str, str]:
    """(artifact digest, exact digest) of the state dict, in one pass over it in name order.

    The artifact digest is SHA-256 over each tensor's name, shape and bytes rounded to bfloat16:
    the same whether the checkpoint was loaded in float32, bfloat16 or float16-from-bf16, so
    artifacts match the model, not the load dtype. The exact digest also names each tensor's
    dtype and hashes its own bytes (a bfloat16 tensor's are the rounded ones, hashed once)."""
    rounded, exact = hashlib.sha256(), hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        head = name.encode() + str(tuple(tensor.shape)).encode()
        rounded.update(head)
        exact.update(head + str(tensor.dtype).encode())
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        if flat.dtype != torch.bfloat16:
            exact.update(flat.view(torch.uint8).numpy().tobytes())
            flat = flat.to(torch.bfloat16)
        rounded.update(flat.view(torch.uint8).numpy().tobytes())
    artifact = rounded.hexdigest()
    exact.update(artifact.encode())  # the bfloat16 tensors' own bytes
    return artifact, exact.hexdigest()


def weight_digest(model: torch.nn.Module) -> str:
    """The artifact digest (`weight_digests`)."""
    return weight_digests(model)[0]


# config keys that never change what the forward computes: names, bookkeeping, generation and
# training defaults, the load dtype (in the identity on its own). Every other key is hashed, so a
# key transformers adds later separates identities (no reuse) rather than merging them.
CONFIG_IGNORED = frozenset(
    """_name_or_path name_or_path transformers_version _commit_hash architectures dtype torch_dtype
    use_cache return_dict output_hidden_states output_attentions output_scores return_dict_in_generate
    id2label label2id problem_type finetuning_task task_specific_params tokenizer_class prefix
    bos_token_id eos_token_id pad_token_id sep_token_id decoder_start_token_id initializer_range
    chunk_size_feed_forward torchscript use_bfloat16 tf_legacy_loss pruned_heads max_length min_length
    do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature top_k top_p typical_p
    repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids
    num_return_sequences forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens""".split()
)


def _normalized(value: object) -> object:
    """A config value in one spelling: numbers as floats (10000 and 10000.0 are one rope_theta),
    mappings with sorted keys (json sorts them), sequences as lists."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _normalized(v) for k, v in value.items() if k not in CONFIG_IGNORED}
    if isinstance(value, list | tuple):
        return [_normalized(v) for v in value]
    return str(value)


def config_digest(config) -> str:
    """SHA-256 of the model config's fields that shape the forward (all but CONFIG_IGNORED),
    normalized (`_normalized`): a rope_theta, rope scaling, sliding window, norm eps or head
    dimension change gives another digest."""
    fields = _normalized(config.to_dict())
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def model_identity(exact_weights: str, config: str, dtype: str) -> str:
    """The identity of the K/V a model computes: its exact weight digest, config digest and
    compute dtype."""
    return hashlib.sha256(f"scd.model.identity.v1|{exact_weights}|{config}|{dtype}".encode()).hexdigest()


def owned_weights(model: torch.nn.Module) -> None:
    """Every parameter and buffer in this process's own memory. from_pretrained leaves CPU tensors
    already in the checkpoint's dtype as views of the mapped file, which an in-place write of the
    file (`cp` over it) changes under a running service, after the digests below were taken (the
    same hazard as an SCD artifact's tensors: shared.scd.artifact.owned). Copying a 135M-parameter
    float32 model takes 0.3 s of its 1.3-1.6 s load (one thread; a conversion to another dtype copies anyway)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:  # tied weights: one Parameter, copied once
            tensor.data = tensor.data.clone()


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
    owned_weights(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    artifact_digest, exact_digest = weight_digests(model)
    info = ModelInfo(
        model_id=model_id,
        weight_digest=artifact_digest,
        architecture=type(model).__name__,
        dtype=dtype,
        device=str(target),
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        hidden_size=cfg.hidden_size,
        vocab_size=cfg.vocab_size,
        dtype_reason=choice.reason,
        identity=model_identity(exact_digest, config_digest(model.config), dtype),
        origin=pretrained.origin(path),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


@torch.inference_mode()
def warm_up(loaded: LoadedModel, tokens: int = 16) -> None:
    """One short forward of the serving forward (shared.model: it fuses the projections once,
    here) so the first request does not pay for lazy initialization (and the K/V limits the
    codecs check rebuilt layers against, and the residual stream's that recompute's check reads)."""
    _ = loaded.kv_bounds, loaded.hidden_bounds
    ids = torch.arange(tokens, device=loaded.device).remainder(loaded.info.vocab_size)
    forward_of(loaded).prefill(ids)
