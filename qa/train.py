"""Rebuild the QA model pair from seeds: base P from scratch, then tuned C fine-tuned from P.

Owns the model architecture, the optimizer schedule, the fact-count curriculum and the
checkpoint layout (`<out>/qa-base`, `<out>/qa-tuned`: safetensors + config + tokenizer, plus
`<out>/loss_curve.png` and `<out>/train_summary.json`). Plain torch loop on CPU with a tqdm bar.

    python -m qa.train [--out checkpoints] [--threads 1] [--layers 2] [--tuned-only]

Every step = a QA batch (one train-split seed per row, several queries per context, loss on
answer tokens) + an auxiliary copy batch (see qa.batches). The base phase raises the number of
facts by 8 whenever answer-token accuracy stays above 0.85; the tuned phase samples fact counts
over the full range and mixes base-task queries in, so C stays a plausible fine-tuned expert.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from qa.batches import Batch, copy_batch, qa_batch
from qa.evaluate import evaluate
from qa.predict import own_prefill
from qa.task import SPLIT_SIZE, Task
from qa.tokenizer import build_tokenizer

MODEL_SEED = 1234  # torch seed for P's initial weights


@dataclass(frozen=True)
class Phase:
    name: str  # checkpoint folder name
    task: Task  # task whose validation EM is logged
    steps: int
    lr: float
    warmup: int
    queries: tuple[Task, ...]  # the task of each query after a context
    min_facts: int  # curriculum start (or the lower bound when curriculum=False)
    max_facts: int
    curriculum: bool
    first_seed: int  # train-split seed of the first QA row of the phase
    batch_size: int = 16
    copy_batch_size: int = 32
    decay_from: float = 0.0  # fraction of steps at constant lr before the cosine decay
    data_seed: int = 0  # fact-count and copy-task stream
    eval_every: int = 100


BASE = Phase("qa-base", "base", steps=1300, lr=2e-3, warmup=100, queries=("base",) * 16,
             min_facts=8, max_facts=120, curriculum=True, first_seed=0, data_seed=1, decay_from=0.75)
TUNED = Phase("qa-tuned", "tuned", steps=500, lr=1e-3, warmup=20, queries=("tuned",) * 12 + ("base",) * 4,
              min_facts=8, max_facts=120, curriculum=False, first_seed=SPLIT_SIZE // 2, data_seed=2,
              decay_from=0.0)


def model_config(vocab_size: int, pad_id: int, bos_id: int, eos_id: int, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
        tie_word_embeddings=True, pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=eos_id,
        attn_implementation="sdpa",
    )


def lr_at(step: int, phase: Phase) -> float:
    """Linear warm-up, constant until `decay_from` of the steps, then cosine down to 10%."""
    if step < phase.warmup:
        return phase.lr * (step + 1) / phase.warmup
    start = max(phase.warmup, int(phase.decay_from * phase.steps))
    if step < start:
        return phase.lr
    progress = (step - start) / max(1, phase.steps - start)
    return phase.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def masked_loss(model, batch: Batch) -> tuple[torch.Tensor, float]:
    """Cross-entropy over target positions only; (loss, argmax accuracy on those targets)."""
    hidden = model.model(input_ids=batch.ids, use_cache=False).last_hidden_state  # [B, T, H]
    targets = batch.loss_mask[:, 1:]  # [B, T-1]: position t+1 is predicted from t
    logits = model.lm_head(hidden[:, :-1][targets])  # [n_targets, vocab]
    labels = batch.ids[:, 1:][targets]  # [n_targets]
    loss = F.cross_entropy(logits, labels)
    return loss, (logits.argmax(-1) == labels).float().mean().item()


@dataclass
class History:
    step: list[int] = field(default_factory=list)
    qa_loss: list[float] = field(default_factory=list)
    copy_loss: list[float] = field(default_factory=list)
    facts: list[int] = field(default_factory=list)
    val_em: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Progress:
    """Where a phase stands: enough to resume it exactly (with the model and optimizer state)."""

    step: int = 0
    seed: int = 0  # next train-split seed
    cur: int = 0  # curriculum: current max facts
    recent: list[float] = field(default_factory=list)
    rng: list = field(default_factory=list)  # random.Random(data_seed).getstate(), JSON-able
    history: History = field(default_factory=History)


def train_phase(model, tok, phase: Phase, val_n: int = 50, progress: Progress | None = None, opt=None,
                checkpoint: Callable[[Progress], None] | None = None, checkpoint_every: int = 0,
                stop_at: float | None = None) -> History:
    """Train one phase (or the rest of it, from `progress` and `opt`). `checkpoint(progress)` is
    called every `checkpoint_every` steps and when `stop_at` (time.time()) passes, which ends
    the phase early (resume later from the checkpoint)."""
    model.train()
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=phase.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(phase.data_seed)
    if progress is None or not progress.rng:
        progress = Progress(seed=phase.first_seed, cur=phase.min_facts)
    else:
        rng.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in progress.rng))
    hist = progress.history
    bar = tqdm(range(progress.step, phase.steps), desc=phase.name, mininterval=2.0)
    for step in bar:
        lo = max(phase.min_facts, progress.cur // 2) if phase.curriculum else phase.min_facts
        hi = progress.cur if phase.curriculum else phase.max_facts
        n_facts = rng.randint(lo, hi)
        qa = qa_batch(range(progress.seed, progress.seed + phase.batch_size), tok, n_facts, list(phase.queries))
        progress.seed += phase.batch_size
        cp = copy_batch(rng, tok, phase.copy_batch_size)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, phase)
        qa_loss, acc = masked_loss(model, qa)
        copy_loss, _ = masked_loss(model, cp)
        (qa_loss + copy_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        hist.step.append(step)
        hist.qa_loss.append(qa_loss.item())
        hist.copy_loss.append(copy_loss.item())
        hist.facts.append(n_facts)
        progress.recent.append(acc)
        if phase.curriculum and len(progress.recent) >= 10 and sum(progress.recent[-10:]) / 10 > 0.85 and progress.cur < phase.max_facts:
            progress.cur, progress.recent = min(progress.cur + 8, phase.max_facts), []
        if (step + 1) % phase.eval_every == 0 or step + 1 == phase.steps:
            model.eval()
            em = evaluate(own_prefill(model, tok), "validation", val_n, 512, phase.task)["em"]
            model.train()
            hist.val_em.append((step + 1, em))
            tqdm.write(f"{phase.name} step {step + 1}: qa_loss {sum(hist.qa_loss[-50:]) / len(hist.qa_loss[-50:]):.3f} "
                       f"copy_loss {sum(hist.copy_loss[-50:]) / len(hist.copy_loss[-50:]):.3f} "
                       f"facts<= {hi} val_em@512 {em:.3f}")
        bar.set_postfix(loss=f"{qa_loss.item():.3f}", copy=f"{copy_loss.item():.2f}", acc=f"{acc:.2f}", facts=progress.cur)
        progress.step = step + 1
        out_of_time = stop_at is not None and time.time() > stop_at
        last = progress.step == phase.steps
        if checkpoint is not None and ((checkpoint_every and progress.step % checkpoint_every == 0) or out_of_time or last):
            progress.rng = list(rng.getstate())
            checkpoint(progress)
        if out_of_time:
            break
    model.eval()
    return hist


def plot(histories: dict[str, History], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(histories), figsize=(6 * len(histories), 4), squeeze=False)
    for ax, (name, h) in zip(axes[0], histories.items()):
        ax.plot(h.step, h.qa_loss, lw=0.7, label="QA answer loss")
        ax.plot(h.step, h.copy_loss, lw=0.7, alpha=0.6, label="copy-task loss")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(name)
        twin = ax.twinx()
        twin.plot(h.step, h.facts, color="gray", lw=0.5, alpha=0.5, label="facts / context")
        twin.set_ylabel("facts per context")
        ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qa.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="checkpoints")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads; 1 is far faster when another process shares the cores")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--base-steps", type=int, default=BASE.steps)
    parser.add_argument("--tuned-steps", type=int, default=TUNED.steps)
    parser.add_argument("--tuned-only", action="store_true",
                        help="reuse <out>/qa-base from an earlier run (same result: phases are seeded separately)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    base_phase = Phase(**{**asdict(BASE), "steps": args.base_steps})
    tuned_phase = Phase(**{**asdict(TUNED), "steps": args.tuned_steps})

    torch.manual_seed(MODEL_SEED)
    model = LlamaForCausalLM(model_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, args.layers))
    histories, summary = {}, {"threads": args.threads, "model_seed": MODEL_SEED, "layers": args.layers}
    phases = (base_phase, tuned_phase)
    if args.tuned_only:
        model = LlamaForCausalLM.from_pretrained(out / BASE.name).eval()
        summary = json.loads((out / "train_summary.json").read_text())
        if "history" in summary[BASE.name]:
            histories[BASE.name] = History(**summary[BASE.name]["history"])
        phases = (tuned_phase,)
    for phase in phases:
        p0 = time.time()
        torch.manual_seed(MODEL_SEED + phase.data_seed)
        histories[phase.name] = hist = train_phase(model, tok, phase)
        model.save_pretrained(out / phase.name)  # safetensors, fp32
        tok.save_pretrained(out / phase.name)
        wall = time.time() - p0
        summary[phase.name] = {"phase": asdict(phase), "wall_s": round(wall, 1), "val_em_512": hist.val_em,
                               "history": asdict(hist)}
        print(f"{phase.name}: {phase.steps} steps in {wall:.1f} s, saved to {out / phase.name}", flush=True)
    summary["total_wall_s"] = round(sum(summary[p.name]["wall_s"] for p in (base_phase, tuned_phase)), 1)
    plot(histories, out / "loss_curve.png")
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"total wall time {summary['total_wall_s']:.1f} s on {args.threads} threads", flush=True)


if __name__ == "__main__":
    main()
