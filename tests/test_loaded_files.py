"""What a service loaded stays what it loaded, whatever happens to the file afterwards.

safetensors' load_file (and transformers' from_pretrained, for CPU tensors already in the
checkpoint's dtype) map the file: tensors read straight from it follow a later in-place write
(`cp` of a newer file over it: same inode). In a real.quality run, a copy of the real pair's
artifact with `keep_points` (5 KB more header) overwrote the loaded one: every tensor shifted, and
layer 0's basis, the first tensor, read the header's JSON as float32 (up to 1.8e37), so layer 0's
rebuilt keys reached 2.4e36 (DataLoss; a same-length rewrite would have changed the values with no
error at all). Committed QA artifact and the tiny model, no server."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared import tiny
from shared.models import load_model
from shared.scd.artifact import Artifact

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "artifacts" / "qa-base-to-tuned.safetensors"


def overwrite_in_place(path: Path, newer: Path) -> None:
    """What `cp newer path` does: truncate and rewrite the same inode."""
    inode = os.stat(path).st_ino
    shutil.copyfile(newer, path)
    assert os.stat(path).st_ino == inode


def changed(now: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name for name, t in now.items() if not torch.equal(t, before[name]))


def test_an_artifact_file_overwritten_in_place_leaves_the_loaded_tensors_as_they_were(tmp_path):
    path = tmp_path / "a.safetensors"
    shutil.copyfile(COMMITTED, path)
    art = Artifact.load(path)
    loaded = {name: t.clone() for name, t in art.tensors.items()}
    first = "layer.0.basis"  # the first tensor in the file (names in order): right after the header
    assert float(art.tensors[first].abs().max()) <= 1  # orthonormal

    newer = tmp_path / "newer.safetensors"  # the same tensors, a longer header (one more measured section)
    meta = {**art.meta, "keep_points": [{"mode": "scd", "pad": "x" * 4000}]}
    save_file({k: v.contiguous() for k, v in loaded.items()}, str(newer), metadata={"scd": json.dumps(meta)})
    overwrite_in_place(path, newer)

    moved = changed(art.tensors, loaded)
    assert not moved, (
        f"{len(moved)} tensors changed with the file ({moved[:3]}...): max |{first}| now {float(art.tensors[first].abs().max()):.3g}"
    )


def test_a_checkpoint_overwritten_in_place_leaves_the_loaded_weights_as_they_were(tmp_path):
    path = tmp_path / "tiny-llama"
    shutil.copytree(tiny.ensure_tiny("tiny-llama"), path)
    loaded = load_model(str(path), "float32", "cpu")  # the checkpoint's own dtype: nothing converted
    params = dict(loaded.model.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}

    newer = tmp_path / "newer.safetensors"  # every weight doubled, the header the same length: no shift
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: (2 * v).contiguous() for k, v in weights.items()}, str(newer), metadata={"format": "pt"})
    del weights
    overwrite_in_place(path / "model.safetensors", newer)

    moved = changed({name: p.detach() for name, p in params.items()}, before)
    assert not moved, (
        f"{len(moved)} of {len(params)} weights changed with the file ({moved[:3]}...), digest still {loaded.info.weight_digest[:16]}"
    )
