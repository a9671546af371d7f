"""The deep pair's training mechanics (qa.deep): depth growth preserves the trained model's
function exactly, and a phase interrupted at a checkpoint resumes to the same weights as an
uninterrupted run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from qa import deep
from qa.tokenizer import build_tokenizer
from qa.train import BASE, model_config

ROOT = Path(__file__).resolve().parent.parent


def test_growing_the_trained_base_keeps_its_function():
    small = LlamaForCausalLM.from_pretrained(ROOT / "checkpoints/qa-base").eval()
    big = deep.grow(small)
    assert big.config.num_hidden_layers == 3 * small.config.num_hidden_layers
    ids = torch.randint(4, small.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(small(ids).logits, big(ids).logits, atol=1e-5)


def test_an_interrupted_phase_resumes_to_the_same_weights(tmp_path):
    tok = build_tokenizer()
    phase = replace(BASE, name="tiny-phase", steps=4, batch_size=2, copy_batch_size=2, min_facts=4, max_facts=8,
                    eval_every=1000, warmup=1)

    def fresh():
        torch.manual_seed(0)
        return LlamaForCausalLM(model_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, 1))

    straight = fresh()
    assert deep.run_phase(tmp_path / "a", phase, straight, tok, stop_at=float("inf"), checkpoint_every=2)
    first = fresh()
    assert not deep.run_phase(tmp_path / "b", phase, first, tok, stop_at=0.0, checkpoint_every=2)  # stops after step 1
    resumed = fresh()  # a new process: only the saved state carries over
    assert deep.run_phase(tmp_path / "b", phase, resumed, tok, stop_at=float("inf"), checkpoint_every=2)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_a_lora_fine_tune_trains_only_its_adapters_and_merges_into_plain_weights(tmp_path):
    tok = build_tokenizer()
    torch.manual_seed(0)
    base = LlamaForCausalLM(model_config(len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, 1))
    base.save_pretrained(tmp_path / "base")
    phase = replace(deep.DEEP_LORA, name="tiny-lora", steps=3, batch_size=2, copy_batch_size=2, min_facts=4, max_facts=8,
                    eval_every=1000, warmup=1)
    assert deep.fine_tune(tmp_path, phase, tmp_path / "base", tok, stop_at=float("inf"), checkpoint_every=2, lora=True)
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "tiny-lora").eval()
    assert not any("lora" in name for name in merged.state_dict())
    original = LlamaForCausalLM.from_pretrained(tmp_path / "base").eval()
    changed = {n for n, t in merged.state_dict().items() if not torch.equal(t, original.state_dict()[n])}
    assert changed and all(n.split(".")[-2] in deep.LORA_TARGETS for n in changed)  # only adapted projections moved
    # the merged weights compute what the trained adapters did
    _, adapted = deep.add_lora(LlamaForCausalLM.from_pretrained(tmp_path / "base"))
    state = torch.load(tmp_path / "state" / "tiny-lora" / "model.pt")
    adapted.load_state_dict(state)
    ids = torch.randint(4, len(tok), (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(adapted.eval()(ids).logits, merged(ids).logits, atol=1e-4)
