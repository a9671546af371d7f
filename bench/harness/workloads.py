"""Model scales the TTFT benchmark runs: the trained QA pair, the real pair (SmolLM2-135M-Instruct
-> its fine-tune here, on real.tasks contexts), Qwen2.5-0.5B- and 7B-shaped random models (built
once into .cache/models), or a tiny/builtin model; each with the inputs it is fed."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import services

CHECKPOINTS = services.ROOT / "checkpoints"
# tiny and trained stay float32 (their rows compare answers token for token across settings);
# the Qwen shapes run the services' default, auto: bfloat16 where the device computes it natively,
# else float32 (resolved here, so the rows and the services' --dtype name the dtype that ran)
SCALE_DTYPE = {"tiny": "float32", "trained": "float32", "real": "float32", "qwen05b": "auto", "qwen7b": "auto"}
REAL_PAIR = ("smollm2-135m", "smollm2-135m-tuned")


def resolved_dtype(requested: str, device: str = "auto") -> str:
    """The dtype the services compute in for `--dtype requested` on `device` of this machine
    (shared.compute_dtype's rule), noted with its reason when it was auto."""
    from shared.compute_dtype import AUTO, resolve
    from shared.models import resolve_device

    if requested != AUTO:
        return requested
    choice = resolve(requested, resolve_device(device))
    note(choice.reason)
    return choice.dtype


def note(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


QWEN05B = dict(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
               rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Qwen2.5-7B's geometry (28 layers, hidden 3584, 4 KV heads x 128: 57,344 raw KV bytes/token in
# bf16), vocab cut to 32000 like QWEN05B: ~6.6e9 parameters, ~13 GB in bf16.
QWEN7B = dict(QWEN05B, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
              num_key_value_heads=4, tie_word_embeddings=False)
RANDOM_MODELS = {"qwen05b-random": QWEN05B, "qwen7b-random": QWEN7B}


def ensure_random(name: str, config: dict, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """A Qwen2 model of `config` with random weights (`dtype`) plus a word-level tokenizer of its
    vocab (`w4`, `w5`, ...), built once into .cache/models/NAME (on CUDA when present: fast
    init) and loaded by the services like any checkpoint. No downloads."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config

    from shared import tiny

    path = tiny.cache_dir() / name
    if (path / "config.json").exists():
        return path
    note(f"building {path} (random weights; once)")
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(len(specials), config["vocab_size"])])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return tiny.save_random(path, Qwen2Config(**config), tokenizer, seed, getattr(torch, dtype), device)


def ensure_qwen05b(seed: int = 0) -> Path:
    """Qwen2.5-0.5B's architecture with random weights (vocab cut from 151936 to 32000 so the
    embedding stays small on CPU; tied embeddings, bf16) in .cache/models/qwen05b-random."""
    return ensure_random("qwen05b-random", QWEN05B, seed)


@dataclass
class Workload:
    """Contexts, questions and stop rule of one model scale. Cold contexts are all distinct."""
    name: str
    producer_model: str
    consumer_model: str
    dtype: str
    vocab_size: int = 0
    qa: bool = False  # contexts from qa.task (trained pair)
    real: bool = False  # contexts from real.tasks (real pair); neither: random token ids
    tokenizer: object = None
    max_new_tokens: int = 2  # the second token times one decode step
    stop_ids: list[int] = field(default_factory=list)
    max_ctx: int | None = None  # longest context the input generator can make
    weights: str = "random"  # what the rows ran on: "trained" checkpoints or "random" weights
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
        if self.real:
            from real import tasks

            family = tasks.FAMILIES[seed % len(tasks.FAMILIES)]
            example = tasks.make(self.tokenizer, family, "test", seed % 100_000_000, ctx_tokens)
            return example.context_ids, example.question_ids, example.answer
        rng = random.Random(seed)
        ctx = [rng.randrange(4, self.vocab_size) for _ in range(ctx_tokens)]
        return ctx, [rng.randrange(4, self.vocab_size) for _ in range(16)], None


def workload_for(scale: str, args) -> Workload | None:
    """The scale's models and inputs, or None (with a note) when it cannot run here."""
    from bench.harness.provenance import weights_of
    from shared.models import resolve_path

    dtype = resolved_dtype(args.dtype or SCALE_DTYPE[scale], getattr(args, "device", None) or "auto")
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
                        max_new_tokens=4, stop_ids=[end_token_id(tok)], max_ctx=max_ctx, weights="trained")
    if scale == "real":
        from transformers import AutoTokenizer

        from real import tasks

        producer, consumer = REAL_PAIR
        tok = AutoTokenizer.from_pretrained(resolve_path(producer))
        return Workload(f"{producer}->{consumer}", producer, consumer, dtype, len(tok), real=True, tokenizer=tok,
                        max_new_tokens=2, stop_ids=[tasks.end_id(tok)], weights=weights_of(producer))
    if scale in ("qwen05b", "qwen7b"):
        name = f"{scale}-random"
        path = str(ensure_random(name, RANDOM_MODELS[name]))
        return Workload(name, path, path, dtype, RANDOM_MODELS[name]["vocab_size"])
    producer = args.producer_model or "tiny-llama"
    consumer = args.consumer_model or producer
    config = json.loads((Path(resolve_path(producer)) / "config.json").read_text())
    name = producer if producer == consumer else f"{producer}->{consumer}"
    weights = "/".join(sorted({weights_of(producer), weights_of(consumer)}))
    return Workload(name, producer, consumer, dtype, config["vocab_size"], weights=weights)
