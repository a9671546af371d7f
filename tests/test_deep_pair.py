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
