"""DistillCache: a learned keep policy. A small network shared by the layers (with a layer
embedding) reads each token's features (shared.keep.features: attention statistics, their
entropy, key and value norms, position, sink and recent flags) and gives one keep score per token
and KV head. Trained offline (calibration.distill_keep: REINFORCE on a per-step KL reward against
the full cache); its weights are a small file beside the pair's SCD artifact,
`<artifact stem>.keep.safetensors`, committed with the repo.

`register(artifact)` makes POLICIES["distill"] load that file (a clear error naming it when it is
absent); until then asking for "distill" says how to register it. Knows nothing about training,
codecs or services.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from shared.keep import features
from shared.keep.policy import POLICIES, SNAPKV_WINDOW, LayerView, Needs

FORMAT = "scd.keep.distill.v1"
SUFFIX = ".keep.safetensors"
TRAIN_COMMAND = "python -m calibration.distill_keep"


class DistillNet(nn.Module):
    """scores [..., T] from features [..., T, F] and layer indices [...]: a linear read of the
    features plus an MLP over them and the layer's embedding. At initialization the MLP's output is
    zero and the linear part reads the pooled window attention only (SnapKV's signal), so training
    starts from a known heuristic."""

    def __init__(self, num_layers: int, hidden: int = 32, embed: int = 4):
        super().__init__()
        n = len(features.NAMES)
        self.num_layers, self.hidden, self.embed = num_layers, hidden, embed
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

    def forward(self, feats: torch.Tensor, layers: torch.Tensor) -> torch.Tensor:
        emb = self.layer(layers)  # [..., E]
        emb = emb.view(*emb.shape[:-1], *([1] * (feats.dim() - 1 - layers.dim())), emb.shape[-1]).expand(*feats.shape[:-1], -1)
        return self.linear(feats)[..., 0] + self.mlp(torch.cat([feats, emb], dim=-1))[..., 0]


class DistillCache:
    """The policy: scores [n_kv, T] of one layer's view from the network."""

    name = "distill"
    needs = Needs.WINDOW_ATTENTION | Needs.ACCUMULATED_ATTENTION
    observation = SNAPKV_WINDOW

    def __init__(self, net: DistillNet, source: str = ""):
        self.net, self.source = net.eval(), source

    @torch.no_grad()
    def score(self, view: LayerView) -> torch.Tensor:
        if not 0 <= view.index < self.net.num_layers:
            raise ValueError(f"distill ({self.source}): layer {view.index} outside the weights' {self.net.num_layers} layers")
        feats = features.token_features(view)  # [n_kv, T, F]
        return self.net(feats, torch.tensor(view.index)).float()


def save(net: DistillNet, path: Path, meta: dict) -> None:
    """The weights and what trained them (JSON in the file's metadata)."""
    header = {"format": FORMAT, "num_layers": net.num_layers, "hidden": net.hidden, "embed": net.embed}
    header["features"] = list(features.NAMES)
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
    net = DistillNet(meta["num_layers"], meta["hidden"], meta["embed"])
    net.load_state_dict(load_file(str(path)))
    return DistillCache(net, str(path))


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
