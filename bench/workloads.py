"""Model scales the TTFT benchmark runs: the trained QA pair, a Qwen2.5-0.5B-shaped random
model (built once into .cache/models), or a tiny/builtin model; each with the inputs it is fed."""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench import services

CHECKPOINTS = services.ROOT / "checkpoints"
SCALE_DTYPE = {"tiny": "float32", "trained": "float32", "qwen05b": "bfloat16"}


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


QWEN05B = dict(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)


def ensure_qwen05b(seed: int = 0) -> Path:
    """Qwen2.5-0.5B's architecture with random weights (vocab cut from 151936 to 32000 so the
    embedding stays small on CPU; tied embeddings, bf16), plus a 32000-word word-level
    tokenizer; built once into .cache/models/qwen05b-random."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    from shared import tiny

    path = tiny.cache_dir() / "qwen05b-random"
    if (path / "config.json").exists():
        return path
    note(f"building {path} (random weights, ~0.8 GB; once)")
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(len(specials), QWEN05B["vocab_size"])])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN05B), dtype=torch.bfloat16)
    tmp = path.with_name(f".qwen05b-random.{os.getpid()}.tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not path.exists():
        tmp.rename(path)
    return path


@dataclass
class Workload:
    """Contexts, questions and stop rule of one model scale. Cold contexts are all distinct."""
    name: str
    producer_model: str
    consumer_model: str
    dtype: str
    vocab_size: int = 0
    qa: bool = False  # contexts from qa.task (trained pair), else random token ids
    tokenizer: object = None
    max_new_tokens: int = 2  # the second token times one decode step
    stop_ids: list[int] = field(default_factory=list)
    max_ctx: int | None = None  # longest context the input generator can make
    _serial: int = 0

    def request(self, ctx_tokens: int, warm: bool) -> tuple[list[int], list[int], str | None]:
        """(context ids, question ids, gold answer or None); warm: the same context every time."""
        self._serial += 1
        seed = ctx_tokens if warm else 1_000_000 + self._serial
        if self.qa:
            from qa.task import make_example

            ex = make_example(seed=seed, split="test", ctx_tokens=ctx_tokens, task="tuned")
            ctx = self.tokenizer(ex.context)["input_ids"]
            question = self.tokenizer(ex.question, add_special_tokens=False)["input_ids"]
            return ctx, question, ex.answer
        rng = random.Random(seed)
        ctx = [rng.randrange(4, self.vocab_size) for _ in range(ctx_tokens)]
        return ctx, [rng.randrange(4, self.vocab_size) for _ in range(16)], None


def workload_for(scale: str, args) -> Workload | None:
    """The scale's models and inputs, or None (with a note) when it cannot run here."""
    from shared.models import resolve_path

    dtype = args.dtype or SCALE_DTYPE[scale]
    if scale == "trained":
        base, tuned = CHECKPOINTS / "qa-base", CHECKPOINTS / "qa-tuned"
        if not ((base / "config.json").exists() and (tuned / "config.json").exists()):
            note(f"skip scale trained: {base} and {tuned} not found (make models)")
            return None
        from qa.task import FACT_TOKENS, VALUES
        from qa.tokenizer import end_token_id, load_tokenizer

        tok = load_tokenizer(base)
        max_ctx = FACT_TOKENS * (len(VALUES) // 2) + 1  # every value word once per context
        return Workload("qa-base->qa-tuned", str(base), str(tuned), dtype, len(tok), qa=True, tokenizer=tok,
                        max_new_tokens=4, stop_ids=[end_token_id(tok)], max_ctx=max_ctx)
    if scale == "qwen05b":
        path = str(ensure_qwen05b())
        return Workload("qwen05b-random", path, path, dtype, QWEN05B["vocab_size"])
    producer = args.producer_model or "tiny-llama"
    consumer = args.consumer_model or producer
    config = json.loads((Path(resolve_path(producer)) / "config.json").read_text())
    name = producer if producer == consumer else f"{producer}->{consumer}"
    return Workload(name, producer, consumer, dtype, config["vocab_size"])
