"""DistillCache: a learned keep policy. A small network gives one keep score per token and KV head
from what its weights say it reads: each token's features (shared.keep.features: attention
statistics, their entropy, key and value norms, position, sink and recent flags; one network for
every layer, with a layer embedding) and / or the token's normed input to the layer (a linear
probe per layer and KV head). Trained offline (calibration.distill_keep: a probe first fitted to
the full cache's attention while answering, calibration.keep_attention, then REINFORCE on a
per-step KL reward against the full cache); its weights are a small file beside the pair's SCD
artifact, `<artifact stem>.keep.safetensors`, committed with the repo (format v2: the header names
the inputs).

`register(artifact)` makes POLICIES["distill"] load that file (a clear error naming it when it is
absent); until then asking for "distill" says how to register it. Knows nothing about training,
codecs or services.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shared.keep import features
from shared.keep.policy import POLICIES, SNAPKV_WINDOW, LayerView, Needs

FORMAT = "scd.keep.distill.v2"
SUFFIX = ".keep.safetensors"
TRAIN_COMMAND = "python -m calibration.distill_keep"
LEARNED = ("distill",)  # keep policies whose weights are a pair's (the file beside its artifact)
INPUTS = ("features", "normed")  # what a network may read: shared.keep.features, the layer's normed input


class DistillNet(nn.Module):
    """scores [..., n_kv, T] for layer indices [...] from what `inputs` names:

    - "features" (feats [..., n_kv, T, F], shared.keep.features): a linear read of the features plus
      an MLP over them and the layer's embedding. At initialization the MLP's output is zero and the
      linear part reads the pooled window attention only (SnapKV's signal), so training starts from
      a known heuristic. Needs both attention statistics (a T x T pass per layer for H2O's).
    - "normed" (normed [..., T, d]): a linear probe per layer and KV head over the token's normed
      input to that layer (a retaining head, as Locret's): what the token is, not how it was
      attended. Zero at initialization; calibration.keep_attention fits it to the attention the
      full cache gives each token while answering. Needs nothing but the layer's input, so a
      producer scores each layer as its prefill reaches it.
    """

    def __init__(
        self,
        num_layers: int,
        hidden: int = 32,
        embed: int = 4,
        inputs: tuple[str, ...] = ("features",),
        d_model: int = 0,
        num_kv_heads: int = 0,
    ):
        super().__init__()
        if not inputs or any(i not in INPUTS for i in inputs):
            raise ValueError(f"distill inputs: {inputs!r}, each one of {INPUTS}")
        if "normed" in inputs and (d_model < 1 or num_kv_heads < 1):
            raise ValueError(f"distill: a 'normed' probe needs d_model and num_kv_heads (got {d_model}, {num_kv_heads})")
        self.num_layers, self.hidden, self.embed = num_layers, hidden, embed
        self.inputs, self.d_model, self.num_kv_heads = tuple(inputs), d_model, num_kv_heads
        if "features" in inputs:
            n = len(features.NAMES)
            self.layer = nn.Embedding(num_layers, embed)
            self.linear = nn.Linear(n, 1)
            first, out = nn.Linear(n + embed, hidden), nn.Linear(hidden, 1)  # created in this order: the seed's init
            self.mlp = nn.Sequential(first, nn.GELU(), out)
            with torch.no_grad():
                self.linear.weight.zero_()
                self.linear.bias.zero_()
                self.linear.weight[0, features.NAMES.index("window_pool5")] = 2.0
                out.weight.zero_()
                out.bias.zero_()
        if "normed" in inputs:
            self.probe = nn.Parameter(torch.zeros(num_layers, d_model, num_kv_heads))
            self.probe_bias = nn.Parameter(torch.zeros(num_layers, num_kv_heads))

    @property
    def needs(self) -> Needs:
        needs = Needs.NONE
        if "features" in self.inputs:
            needs |= Needs.WINDOW_ATTENTION | Needs.ACCUMULATED_ATTENTION
        if "normed" in self.inputs:
            needs |= Needs.NORMED
        return needs

    def forward(
        self, layers: torch.Tensor, feats: torch.Tensor | None = None, normed: torch.Tensor | None = None
    ) -> torch.Tensor:
        out: torch.Tensor | float = 0.0
        if "features" in self.inputs:
            if feats is None:
                raise ValueError("distill: this network reads features (shared.keep.features)")
            emb = self.layer(layers)  # [..., E]
            emb = emb.view(*emb.shape[:-1], *([1] * (feats.dim() - 1 - layers.dim())), emb.shape[-1]).expand(
                *feats.shape[:-1], -1
            )
            out = self.linear(feats)[..., 0] + self.mlp(torch.cat([feats, emb], dim=-1))[..., 0]
        if "normed" in self.inputs:
            if normed is None:
                raise ValueError("distill: this network reads the layer's normed input")
            w, b = self.probe[layers], self.probe_bias[layers]  # [..., d, n_kv], [..., n_kv]
            out = out + torch.matmul(normed.to(w.dtype), w).transpose(-1, -2) + b[..., None]
        assert isinstance(out, torch.Tensor)
        return out


class DistillCache:
    """The policy: scores [n_kv, T] of one layer's view from the network."""

    name = "distill"
    observation = SNAPKV_WINDOW

    def __init__(self, net: DistillNet, source: str = "", digest: str = ""):
        self.net, self.source, self.digest = net.eval(), source, digest
        self.needs = net.needs

    @property
    def weights(self) -> dict:
        """What a result row names: the inputs the weights read and their file's digest."""
        return {"inputs": list(self.net.inputs), "sha256": self.digest, "file": Path(self.source).name}

    @torch.no_grad()
    def score(self, view: LayerView) -> torch.Tensor:
        if not 0 <= view.index < self.net.num_layers:
            raise ValueError(f"distill ({self.source}): layer {view.index} outside the weights' {self.net.num_layers} layers")
        feats = features.token_features(view) if "features" in self.net.inputs else None  # [n_kv, T, F]
        normed = None
        if "normed" in self.net.inputs:
            if view.normed is None or view.normed.shape[-1] != self.net.d_model:
                got = None if view.normed is None else list(view.normed.shape)
                raise ValueError(
                    f"distill ({self.source}): layer {view.index} needs its normed input [T, {self.net.d_model}], got {got}"
                )
            normed = view.normed.float()
        layer = torch.tensor(view.index, device=next(self.net.parameters()).device)
        return self.net(layer, feats, normed).float()


def save(net: DistillNet, path: Path, meta: dict) -> None:
    """The weights and what trained them (JSON in the file's metadata)."""
    header = {"format": FORMAT, "num_layers": net.num_layers, "hidden": net.hidden, "embed": net.embed}
    header.update(inputs=list(net.inputs), d_model=net.d_model, num_kv_heads=net.num_kv_heads, features=list(features.NAMES))
    tensors = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    save_file(tensors, str(path), metadata={"distill": json.dumps({**header, "trained": meta})})


def meta_of(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return json.loads((f.metadata() or {})["distill"])


def load(path: Path) -> DistillCache:
    """The policy from its weights file; ValueError naming the file when it is absent or not ours."""
    if not path.exists():
        raise ValueError(f"keep policy 'distill': no weights at {path} (train them: {TRAIN_COMMAND})")
    try:
        meta = meta_of(path)
    except (KeyError, OSError, json.JSONDecodeError) as e:
        raise ValueError(f"keep policy 'distill': {path} is not a distill weights file ({e})") from None
    if meta.get("format") != FORMAT or meta.get("features") != list(features.NAMES):
        raise ValueError(
            f"keep policy 'distill': {path} has format {meta.get('format')!r} / features {meta.get('features')}, not {FORMAT}"
        )
    try:
        net = DistillNet(
            meta["num_layers"], meta["hidden"], meta["embed"], tuple(meta["inputs"]), meta["d_model"], meta["num_kv_heads"]
        )
        net.load_state_dict(load_file(str(path)))
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"keep policy 'distill': {path}: {e}") from None
    return DistillCache(net, str(path), hashlib.sha256(path.read_bytes()).hexdigest()[:16])


def weights_path(artifact: Path) -> Path:
    """artifacts/smollm2-pc.safetensors -> artifacts/smollm2-pc.keep.safetensors."""
    return artifact.with_name(artifact.name.removesuffix(".safetensors") + SUFFIX)


def register(artifact: Path) -> Path:
    """POLICIES["distill"] loads the weights beside `artifact` (the pair's); returns their path."""
    path = weights_path(Path(artifact))
    POLICIES["distill"] = lambda: load(path)
    return path


def _unregistered() -> DistillCache:
    raise ValueError(
        f"keep policy 'distill': no pair registered (shared.keep.distill.register(artifact) loads <artifact>{SUFFIX})"
    )


POLICIES.setdefault("distill", _unregistered)
