"""The deeper QA pair (6 decoder layers, contexts up to 1024 tokens), trained in resumable phases:

  grow   the trained 2-layer base becomes 6 layers, function-preserving: new decoder layers
         whose attention and MLP output projections are zero (each computes the identity) are
         inserted after each original layer, so at step 0 the deep model is the 2-layer model;
  base   continue training on the base task with longer contexts (curriculum up to 200 facts,
         about 1000 tokens) so every layer takes part;
  tuned  full fine-tune of `base` on the shifted task (consumer C1);
  lora   LoRA fine-tune of `base` on the shifted task (`peft`, rank 16 on every projection),
         merged into the weights for serving (consumer C2; its digest is the merged weights').

Each phase checkpoints every `--checkpoint-every` steps into `<out>/state/<phase>/` (model,
optimizer, data-stream position, history) and resumes from there on the next run, so a long
CPU training run spans sessions: `python -m qa.deep --max-minutes 50` again continues where it
stopped. Finished phases are saved as normal checkpoints `<out>/qa-deep-<phase>/`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from qa.train import BASE, TUNED, History, Phase, Progress, train_phase
from qa.tokenizer import build_tokenizer

EVERY = 3  # the deep model has this many layers per original one: [original, new, new]
DEEP_BASE = replace(BASE, name="qa-deep-base", steps=1200, lr=1e-3, warmup=50, min_facts=96, max_facts=200, first_seed=10_000_000,
                    data_seed=11, decay_from=0.6, eval_every=250)
DEEP_TUNED = replace(TUNED, name="qa-deep-tuned", steps=500, first_seed=60_000_000, data_seed=12, max_facts=200, eval_every=100)
DEEP_LORA = replace(TUNED, name="qa-deep-lora", steps=800, lr=2e-3, first_seed=70_000_000, data_seed=13, max_facts=200,
                    eval_every=100)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def grow(model: LlamaForCausalLM, every: int = EVERY) -> LlamaForCausalLM:
    """A deeper copy of `model`: after each original decoder layer, every-1 new layers whose
    o_proj and down_proj are zero (identity blocks on the residual stream). Same function."""
    config = model.config.to_dict()
    config["num_hidden_layers"] = model.config.num_hidden_layers * every
    deep = LlamaForCausalLM(type(model.config).from_dict(config))
    state = {k: v for k, v in model.state_dict().items() if ".layers." not in k}
    for name, tensor in model.state_dict().items():
        if ".layers." in name:
            head, rest = name.split(".layers.", 1)
            index, tail = rest.split(".", 1)
            state[f"{head}.layers.{int(index) * every}.{tail}"] = tensor
    missing, unexpected = deep.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    with torch.no_grad():
        for i, layer in enumerate(deep.model.layers):
            if i % every:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return deep.eval()


def _state_dir(out: Path, phase: Phase) -> Path:
    return out / "state" / phase.name


def _save_state(out: Path, phase: Phase, model, opt, progress: Progress) -> None:
    path = _state_dir(out, phase)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path / "model.pt")  # plain or LoRA-wrapped alike
    torch.save(opt.state_dict(), path / "optimizer.pt")
    (path / "progress.json").write_text(json.dumps({**asdict(progress), "history": asdict(progress.history)}) + "\n")


def _load_state(out: Path, phase: Phase, model, opt) -> Progress | None:
    path = _state_dir(out, phase)
    if not (path / "progress.json").exists():
        return None
    model.load_state_dict(torch.load(path / "model.pt"))
    opt.load_state_dict(torch.load(path / "optimizer.pt"))
    raw = json.loads((path / "progress.json").read_text())
    raw["history"] = History(**raw["history"])
    return Progress(**raw)


def run_phase(out: Path, phase: Phase, model, tok, stop_at: float, checkpoint_every: int) -> bool:
    """Train (or resume) `phase`; True when it finished, False when time ran out (state saved)."""
    final = out / phase.name
    if (final / "config.json").exists():
        return True
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=phase.lr, betas=(0.9, 0.98), weight_decay=0.01)
    progress = _load_state(out, phase, model, opt)
    if progress is not None:
        print(f"{phase.name}: resuming at step {progress.step}/{phase.steps}", flush=True)
    torch.manual_seed(phase.data_seed + (progress.step if progress else 0))
    train_phase(model, tok, phase, progress=progress, opt=opt, checkpoint_every=checkpoint_every, stop_at=stop_at,
                checkpoint=lambda p: _save_state(out, phase, model, opt, p))
    done = json.loads((_state_dir(out, phase) / "progress.json").read_text())["step"] >= phase.steps
    return done


def save_final(out: Path, phase: Phase, model, tok) -> None:
    model.save_pretrained(out / phase.name)
    tok.save_pretrained(out / phase.name)
    print(f"{phase.name}: saved to {out / phase.name}", flush=True)


def add_lora(model: LlamaForCausalLM, rank: int = 16):
    """(peft wrapper, the same Llama with LoRA adapters injected): only the adapters train."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS, lora_dropout=0.0))
    return peft, peft.get_base_model()


def fine_tune(out: Path, phase: Phase, base_dir: Path, tok, stop_at: float, checkpoint_every: int, lora: bool) -> bool:
    """Train (or resume) a fine-tune of the finished base; saves the consumer when done (a LoRA
    fine-tune merged into plain Llama weights). True when done, False when time ran out."""
    model = LlamaForCausalLM.from_pretrained(base_dir)
    peft = None
    if lora:
        peft, model = add_lora(model)
    if not run_phase(out, phase, model, tok, stop_at, checkpoint_every):
        return False
    if peft is not None:
        model = peft.merge_and_unload()
    save_final(out, phase, model, tok)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m qa.deep", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("checkpoints/deep"))
    p.add_argument("--from", dest="source", type=Path, default=Path("checkpoints/qa-base"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-minutes", type=float, default=50.0, help="stop (state saved) after this long; run again to resume")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--phases", default="base,tuned,lora")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    stop_at = time.time() + 60 * args.max_minutes
    tok = build_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = args.phases.split(",")
    base_dir = args.out / DEEP_BASE.name
    if "base" in wanted and not (base_dir / "config.json").exists():
        model = grow(LlamaForCausalLM.from_pretrained(args.source))
        if not run_phase(args.out, DEEP_BASE, model, tok, stop_at, args.checkpoint_every):
            return
        save_final(args.out, DEEP_BASE, model, tok)
    for phase in (DEEP_TUNED, DEEP_LORA):
        if phase.name.rsplit("-", 1)[1] not in wanted or (args.out / phase.name / "config.json").exists():
            continue
        if not fine_tune(args.out, phase, base_dir, tok, stop_at, args.checkpoint_every, lora=phase is DEEP_LORA):
            return

if __name__ == "__main__":
    main()
