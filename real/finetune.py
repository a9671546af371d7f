"""The real pair's consumer C: SmolLM2-135M-Instruct (P) LoRA-fine-tuned here, seeded.

The shift is format and domain: C answers the real.tasks questions with the bare value(s) ("4821",
"VQIMR, UJUYA, ...", "the garden shed") where P writes a sentence, and it is also trained to
predict the context's own prose (the train split of real.prose), so its states over a context
move away from P's: the loss is answer-token cross-entropy + `--context-weight` x the context's
next-token cross-entropy. Writes the adapter (peft format, bfloat16 tensors: what
`shared.pretrained` merges for the name `smollm2-135m-tuned`), `train_summary.json` (settings,
seeds, wall time, loss per step) and `loss_curve.png` to `--out`.

    python -m real.finetune                     # what shipped (checkpoints/smollm2-135m-tuned)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from real import tasks
from shared import pretrained
from shared.models import load_model

OUT = pretrained.ROOT / "checkpoints/smollm2-135m-tuned"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def step_losses(model, ids: list[int], n_context: int, n_answer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(answer CE, context CE) of one sequence ids = context + question + answer."""
    x = torch.tensor([ids])
    logits = model(input_ids=x).logits[0, :-1].float()  # [n-1, vocab]: position i predicts ids[i+1]
    ce = torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="none")
    return ce[-n_answer:].mean(), ce[: n_context - 1].mean()


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_adapter(model, out: Path) -> None:
    """peft's adapter files with the tensors stored in bfloat16 (half the bytes in git)."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(f"{tmp}/adapter_model.safetensors").items()}
        save_file(tensors, str(out / "adapter_model.safetensors"))
        config = json.loads(Path(f"{tmp}/adapter_config.json").read_text())
        config["base_model_name_or_path"] = "smollm2-135m"  # the short name, not this machine's cache path
        (out / "adapter_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["answer_loss"] for h in history], label="answer CE", lw=0.8)
    ax.plot(steps, [h["context_loss"] for h in history], label="context CE", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("smollm2-135m-tuned: LoRA fine-tune (real.finetune)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def shown(path: Path) -> str:
    """A path as the summary records it: relative to the checkout when inside it."""
    full = path.resolve()
    return str(full.relative_to(pretrained.ROOT)) if full.is_relative_to(pretrained.ROOT) else str(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--context-weight", type=float, default=0.5)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 320, 384], help="context tokens, drawn per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    from peft import LoraConfig, get_peft_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    base = load_model("smollm2-135m", dtype="float32", device="cpu")
    tokenizer = base.tokenizer
    config = LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=TARGETS, lora_dropout=0.0, bias="none")
    model = get_peft_model(base.model, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    history = []
    start = time.perf_counter()
    for step in range(args.steps):
        example = tasks.make(tokenizer, tasks.FAMILIES[step % len(tasks.FAMILIES)], "train", step, rng.choice(args.contexts))
        answer = tasks.answer_ids(tokenizer, example)
        ids = example.context_ids + example.question_ids + answer
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        answer_loss, context_loss = step_losses(model, ids, len(example.context_ids), len(answer))
        (answer_loss + args.context_weight * context_loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        row = {
            "step": step,
            "family": example.family,
            "tokens": len(ids),
            "answer_loss": round(answer_loss.item(), 4),
            "context_loss": round(context_loss.item(), 4),
            "lr": opt.param_groups[0]["lr"],
            "elapsed_s": round(time.perf_counter() - start, 1),
        }
        history.append(row)
        print(json.dumps(row), flush=True)
    save_adapter(model, args.out)
    summary = {
        "command": " ".join(["python -m real.finetune", *(sys.argv[1:] if argv is None else argv)]),
        "base": "smollm2-135m",
        "base_origin": base.info.origin,
        "base_weight_digest": base.info.weight_digest,
        "settings": {k: (shown(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "lora": {"r": args.rank, "alpha": args.alpha, "target_modules": TARGETS, "dropout": 0.0, "stored_dtype": "bfloat16"},
        "optimizer": "AdamW betas (0.9, 0.99), weight decay 0, grad clip 1.0, linear warm-up then cosine to 10 %",
        "data": "real.tasks train split (seeds 0..steps-1, families in turn), real.prose train text",
        "loss": "answer CE + context_weight x context next-token CE",
        "trainable_params": sum(p.numel() for p in params),
        "wall_s": round(time.perf_counter() - start, 1),
        "machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), shared 2-core CPU",
        "history": history,
    }
    (args.out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(history, args.out / "loss_curve.png")


if __name__ == "__main__":
    main()
