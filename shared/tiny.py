"""Tiny random-weight models built deterministically on first use, for exactness tests and as a
no-download default. `ensure_tiny(name)` writes a normal Hugging Face checkpoint directory
(config, safetensors, tokenizer) that `from_pretrained` loads like any other.

Owns the builtin names ("tiny-llama", "tiny-qwen2") and their configs; nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config

_CORPUS = (
    "The producer reads a long context and the consumer writes the answer. "
    "Semantic cache distillation sends compact codes instead of the raw key value cache. "
    "Most layers are rebuilt from low rank subspaces and a few layers are patched. "
    "0 1 2 3 4 5 6 7 8 9 alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. "
)

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

BUILTIN = {
    "tiny-llama": lambda vocab: LlamaConfig(vocab_size=vocab, **_COMMON),
    "tiny-qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, **_COMMON),
}


def cache_dir() -> Path:
    return Path(os.environ.get("SCD_CACHE_DIR", Path(__file__).resolve().parent.parent / ".cache")) / "models"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (every string encodes) trained on a fixed corpus: deterministic."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def save_random(path: Path, config, tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Path:
    """The one random-model builder: a model of `config` with seeded random weights in `dtype`,
    initialized on `device` (the same seed gives other weights on CUDA than on the CPU: the
    builtin tiny models always start on the CPU, large benchmark shapes on CUDA when present,
    which is much faster) and `tokenizer`, written as a
    normal checkpoint directory at `path` (atomically: a concurrent builder never sees half of
    it), unless it is already there. Used for the builtin tiny models and the benchmarks'
    0.5B / 7B shapes."""
    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    del model
    if not path.exists():
        tmp.rename(path)
    return path


def ensure_tiny(name: str, seed: int = 0) -> Path:
    """Return the checkpoint directory of builtin `name`, building it the first time."""
    tokenizer = build_tokenizer()
    return save_random(cache_dir() / name, BUILTIN[name](len(tokenizer)), tokenizer, seed)
