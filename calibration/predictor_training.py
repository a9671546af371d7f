"""Training the learned non-linear predictor of a consumer layer's normalized input (offline;
the model itself and its inference live in shared.scd.predictor).

Training (in fp32, streaming, never holding the corpus): stage 1 minimises the normalized error of C's
pre-RoPE [k | v] computed from the prediction (only W_k, W_v and k_norm of C see it, so that is
the error that reaches the cache); stage 2 adds the end-to-end loss the schedule search
measures (calibration.kl): KL(C with its own cache || C with this layer rebuilt from the
prediction) over the scored continuation tokens (answers to questions about the context),
every other layer C's own.

Examples come from a `Stream` (two full forwards per example per step: fine for the toy pairs) or
a `Pool` (examples captured once, batches drawn from them: what makes a 30-layer pair trainable
on a CPU, where those forwards cost seconds each).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
from transformers import LlamaModel

from calibration import kl, moments
from shared import kv, layers
from shared.models import LoadedModel
from shared.scd.predictor import build, predict


@dataclass(frozen=True)
class TrainExample:
    """One context and the continuations the KL stage scores on top of it (several questions
    about one context give a denser signal than one)."""

    context_ids: list[int]
    continuations: tuple[tuple[list[int], int], ...]  # (ids, index of the first scored token)


@dataclass(frozen=True)
class TrainConfig:
    mse_steps: int = 1500
    kl_steps: int = 2000
    batch: int = 4  # sequences per optimizer step
    lr: float = 2e-3  # peak learning rate, stage 1 (one-cycle schedule)
    kl_lr: float = 5e-4  # peak learning rate, stage 2
    kl_weight: float = 1.0  # stage 2 loss = normalized kv error + kl_weight * KL
    intermediate_mult: int = 2  # MLP width = mult * hidden
    depth: int = 2  # decoder layers in the predictor
    seed: int = 0
    clip: float = 0.0  # max gradient norm per step (0: none); a 30-layer pair's width needs it at lr ~3e-4
    pool: int = 0  # 0: every step reads new examples from the stream; N: N examples captured once (a Pool)
    kl_pool: int = 0  # of the pool's examples, how many keep C's own K/V for the KL stage (0: all)

    def to_json(self) -> dict:
        return asdict(self)


def model_config(consumer: LoadedModel, intermediate_mult: int = 2, depth: int = 2) -> dict:
    """JSON-able LlamaConfig kwargs for a predictor of this consumer's width."""
    cfg = consumer.model.config.get_text_config(decoder=True)
    info = consumer.info
    heads = max(1, info.hidden_size // info.head_dim)
    return {
        "vocab_size": 1,
        "hidden_size": info.hidden_size,
        "intermediate_size": intermediate_mult * info.hidden_size,
        "num_hidden_layers": depth,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": info.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {
            "rope_theta": float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            "rope_type": "default",
        },
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _kv_error(consumer: LoadedModel, layer: int, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of C's pre-RoPE [k | v] from pred vs from target ([T, d] each),
    normalized by the target's per-dimension variance (1.0 = predicting the mean)."""
    kp, vp = layers.kv_pre_rope(consumer, layer, pred.to(consumer.dtype))
    with torch.no_grad():
        kt, vt = layers.kv_pre_rope(consumer, layer, target.to(consumer.dtype))
    yp, yt = torch.cat([kp, vp], -1).float(), torch.cat([kt, vt], -1).float()  # [n_kv, T, 2 hd]
    return ((yp - yt) ** 2).mean() / yt.var(1).mean().clamp_min(1e-12)


@torch.no_grad()
def consumer_pass(
    consumer: LoadedModel, ids: list[int], layer: int
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """C over the context once: its normalized input of `layer` ([T, d], float32) and every
    layer's own (keys, values) ([n_kv, T, hd] each), on C's device."""
    normed, cache = moments.normed_inputs_and_cache(consumer, ids)
    return normed[layer].to(consumer.device), cache_kv(consumer, cache)


def cache_kv(consumer: LoadedModel, cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's (keys, values) of a batch-1 cache, [n_kv, T, hd] each."""
    return [(k[0], v[0]) for k, v in (kv.layer_kv(cache, i) for i in range(consumer.info.num_layers))]


def _kl(
    consumer: LoadedModel, layer: int, pred: torch.Tensor, ex: TrainExample, own_kv: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """KL(C on its own cache `own_kv` || C with `layer` rebuilt from pred), mean over the scored
    tokens of all of ex's continuations; differentiable in pred."""
    keys_pre, values = layers.kv_pre_rope(consumer, layer, pred.to(consumer.dtype))
    keys = layers.rope(consumer, layer, keys_pre, layers.positions(consumer, len(ex.context_ids)))
    mixed_kv = [(keys, values) if i == layer else pair for i, pair in enumerate(own_kv)]
    with torch.no_grad():
        refs = kl.scored_logprobs(consumer, own_kv, ex.continuations)
    logps = kl.scored_logprobs(consumer, mixed_kv, ex.continuations)
    total = sum((kl.kl_sum(r, p) for r, p in zip(refs, logps)), pred.new_zeros(()))
    return total / max(sum(r.shape[0] for r in refs), 1)


@dataclass(frozen=True)
class Sample:
    """One training example as a layer's training step reads it."""

    example: TrainExample
    xp: torch.Tensor  # P's normalized input of the layer, [T, d] float32
    xc: torch.Tensor  # C's, [T, d]
    own_kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # C's own K/V, every layer (None: not kept)


class Stream:
    """Every draw a new example from the stream, P and C run over it then (no memory held)."""

    def __init__(self, producer: LoadedModel, consumer: LoadedModel, examples: Iterator[TrainExample]):
        self.producer, self.consumer, self.examples = producer, consumer, examples

    def draw(self, layer: int, stage: str) -> Sample:
        ex = next(self.examples)
        with torch.no_grad():
            xp = moments.normed_inputs(self.producer, ex.context_ids)[layer].to(self.consumer.device)
        xc, own_kv = consumer_pass(self.consumer, ex.context_ids, layer)
        return Sample(ex, xp, xc, own_kv)


class Pool:
    """`size` examples from the stream, captured once for `layers` (P's and C's normalized inputs;
    C's own K/V, every layer, for the first `kl_size`, which the KL stage draws from), then drawn
    at random with a seeded generator. Memory: 2 x T x d floats per example and layer, plus C's
    whole cache (2 x layers x n_kv x T x hd floats) per KL example."""

    def __init__(
        self,
        producer: LoadedModel,
        consumer: LoadedModel,
        examples: Iterator[TrainExample],
        layers: list[int],
        size: int,
        kl_size: int = 0,
        seed: int = 0,
        log: Callable[[str], None] = lambda m: None,
    ):
        if size < 1:
            raise ValueError(f"pool: {size} examples; must be >= 1")
        self.kl_size = min(kl_size or size, size)
        self.generator = torch.Generator().manual_seed(seed)
        self.items: list[tuple[TrainExample, dict[int, torch.Tensor], dict[int, torch.Tensor], list | None]] = []
        started = time.perf_counter()
        for i in range(size):
            ex = next(examples)
            with torch.no_grad():
                xps = moments.normed_inputs(producer, ex.context_ids)
            xcs, cache = moments.normed_inputs_and_cache(consumer, ex.context_ids)
            # the capture's normalized inputs and the cache's K/V have storage of their own (not views
            # of a larger buffer, which the pool would then hold whole: the test checks)
            xp, xc = ({l: x[l].to(consumer.device) for l in layers} for x in (xps, xcs))
            self.items.append((ex, xp, xc, cache_kv(consumer, cache) if i < self.kl_size else None))
            if (i + 1) % 32 == 0 or i + 1 == size:
                log(f"predictor pool: {i + 1}/{size} examples captured in {time.perf_counter() - started:.0f}s")

    def draw(self, layer: int, stage: str) -> Sample:
        n = self.kl_size if stage == "kl" else len(self.items)
        ex, xps, xcs, own_kv = self.items[int(torch.randint(n, (1,), generator=self.generator))]
        return Sample(ex, xps[layer], xcs[layer], own_kv)


def as_float32(loaded: LoadedModel) -> LoadedModel:
    """The model itself if fp32, else an fp32 copy of its (already rounded) weights: training
    runs in fp32 (bf16 matmuls are slow on CPU and their gradients noisy)."""
    if loaded.dtype == torch.float32:
        return loaded
    return dataclasses.replace(loaded, model=copy.deepcopy(loaded.model).float())


def train(
    producer: LoadedModel,
    consumer: LoadedModel,
    layer: int,
    examples: Iterator[TrainExample] | Pool,
    cfg: TrainConfig,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
) -> tuple[LlamaModel, dict]:
    """Fit layer `layer`'s predictor on examples drawn from `examples`: a stream (at least
    batch * (mse_steps + kl_steps) of them) or a Pool captured for this layer. Returns (model in
    eval mode, report)."""
    torch.manual_seed(cfg.seed + layer)
    started = time.perf_counter()
    producer, consumer = as_float32(producer), as_float32(consumer)  # no copy when already fp32
    source = examples if isinstance(examples, Pool) else Stream(producer, consumer, examples)
    config = model_config(consumer, cfg.intermediate_mult, cfg.depth)
    model = build(config)
    model.to(consumer.device)  # type: ignore[arg-type]  # in place; transformers' wrapped `to` is mistyped
    model.train()
    for p in list(producer.model.parameters()) + list(consumer.model.parameters()):
        p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    curve = []
    for stage, steps, lr in (("kv", cfg.mse_steps, cfg.lr), ("kl", cfg.kl_steps, cfg.kl_lr)):
        if steps == 0:
            continue
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
        for step in range(steps):
            opt.zero_grad()
            err_sum = kl_sum = 0.0
            for _ in range(cfg.batch):
                sample = source.draw(layer, stage)
                pred = predict(model, sample.xp)
                loss = err = _kv_error(consumer, layer, pred, sample.xc)
                if stage == "kl":
                    assert sample.own_kv is not None  # a Pool keeps C's K/V for the examples the KL stage draws
                    kl = _kl(consumer, layer, pred, sample.example, sample.own_kv)
                    loss = err + cfg.kl_weight * kl
                    kl_sum += kl.item() / cfg.batch
                (loss / cfg.batch).backward()
                err_sum += err.item() / cfg.batch
            if cfg.clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            sched.step()
            if step % 50 == 0 or step == steps - 1:
                curve.append({"stage": stage, "step": step, "kv_error": round(err_sum, 5), "kl": round(kl_sum, 5)})
                log(
                    f"predictor layer {layer} {stage} step {step}/{steps}: kv_error {err_sum:.4f}"
                    + (f" kl {kl_sum:.4f}" if stage == "kl" else "")
                )
    model.eval().requires_grad_(False)
    report = {"config": config, "train": cfg.to_json(), "curve": curve, "wall_s": round(time.perf_counter() - started, 1)}
    if isinstance(source, Pool):
        report["pool"] = {"examples": len(source.items), "kl_examples": source.kl_size}
    return model, report
