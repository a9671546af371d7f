"""Calibrating an SCD artifact for a (producer, consumer) pair: `distill(...)`.

Fits the linear maps (calibration.moments), trains learned predictors where asked
(calibration.predictor_training) and refits on them, searches schedules (calibration.search),
profiles the recompute baseline's span (calibration.recompute_profile) and measures the other
transfer modes on the schedules' loss scale (calibration.candidates). The corpus is given:
`python -m calibration` (calibration.__main__) builds it from a file or a provider.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from calibration import audit_thresholds, candidates, moments, predictor_training, search
from calibration.predictor_training import TrainConfig, TrainExample
from calibration.recompute_profile import profile_span
from shared.codecs.recompute import default_span
from shared.models import LoadedModel
from shared.scd import predictor
from shared.scd.artifact import Artifact
from shared.scd.schedule import Action, Geometry


def geometry(info) -> Geometry:
    element = 2 if info.dtype in ("bfloat16", "float16") else 4
    return Geometry(hidden=info.hidden_size, kv_width=2 * info.num_kv_heads * info.head_dim, kv_element_bytes=element)


def distill(
    producer: LoadedModel,
    consumer: LoadedModel,
    corpus: list[list[int]],
    heldout: list[search.HeldOut],
    *,
    corpus_name: str,
    loss_target: float = 0.02,
    generations: int = 30,
    seed: int = 0,
    ridge_rel: float = 1e-3,
    max_schedules: int = 12,
    schedules: list[str] | None = None,
    recompute_span: tuple[int, int] | None = None,
    window: int = 1,
    predictor_layers: str = "none",
    predictor_examples: Iterator[TrainExample] | None = None,
    predictor_train: TrainConfig | None = None,
    log=print,
) -> Artifact:
    """Fit an artifact and measure its schedules: searched (default), or exactly the given
    schedule texts (`schedules`, e.g. for a timing-only model where a search costs too much).
    The recompute baseline's span is profiled (every width up to the default's; on 30 layers
    most of a small calibration's time), or exactly `recompute_span` [start, end) when given.

    predictor_layers (heterogeneous pairs): "none", "all", "auto" (the layers whose Patch through
    the linear map alone loses more than loss_target; "auto:K": the K worst of them) or
    comma-separated layer indices; those
    layers get a learned predictor (calibration.predictor_training) trained on `predictor_examples`, and the
    linear maps are refitted on its output."""
    if recompute_span is not None and not 0 <= recompute_span[0] < recompute_span[1] <= consumer.info.num_layers:
        raise ValueError(f"recompute_span: {list(recompute_span)} is not [start, end) within {consumer.info.num_layers} layers")
    torch.manual_seed(seed)
    predictor_train = predictor_train or TrainConfig()
    started = time.perf_counter()
    same = producer.info.weight_digest == consumer.info.weight_digest
    window = 1 if same else window  # P == C: the token's own state determines its K/V exactly
    layer_moments = moments.collect(producer, consumer, corpus, total=len(corpus), window=window)
    g = geometry(producer.info)
    meta: dict[str, Any] = {
        "producer": {"model_id": producer.info.model_id, "weight_digest": producer.info.weight_digest},
        "consumer": {"model_id": consumer.info.model_id, "weight_digest": consumer.info.weight_digest},
        "corpus": {
            "name": corpus_name,
            "digest": moments.corpus_digest(corpus),
            "sequences": len(corpus),
            "tokens": sum(map(len, corpus)),
        },
        "geometry": {
            "num_layers": consumer.info.num_layers,
            "hidden": g.hidden,
            "kv_width": g.kv_width,
            "kv_element_bytes": g.kv_element_bytes,
            "quant_group": g.quant_group,
        },
        "calibration": {
            "seed": seed,
            "ridge_rel": ridge_rel,
            "homogeneous": same,
            "window": window,
            "loss_target": loss_target,
            "heldout_examples": len(heldout),
            "loss": "mean KL(oracle || reconstructed), nats per answer token",
        },
    }
    art = Artifact(moments.fit(layer_moments, consumer, same, ridge_rel), meta)
    log(f"fitted {consumer.info.num_layers} layers in {time.perf_counter() - started:.1f}s")
    chosen, linear_loss = (
        ([], {}) if same else _predictor_layers(predictor_layers, art, producer, consumer, heldout, loss_target, log)
    )
    if chosen:
        if predictor_examples is None:
            raise ValueError("predictor_layers needs predictor_examples to train on")
        models, reports = {}, {}
        train_p, train_c = (
            predictor_training.as_float32(producer),
            predictor_training.as_float32(consumer),
        )  # one fp32 copy for all layers
        source: Iterator[TrainExample] | predictor_training.Pool = predictor_examples
        if predictor_train.pool:  # captured once for every chosen layer
            source = predictor_training.Pool(
                train_p, train_c, predictor_examples, chosen, predictor_train.pool, predictor_train.kl_pool,
                predictor_train.seed, log,
            )  # fmt: skip
        for layer in chosen:
            models[layer], reports[str(layer)] = predictor_training.train(train_p, train_c, layer, source, predictor_train, log)
        layer_moments = moments.collect(producer, consumer, corpus, total=len(corpus), window=window, predictors=models)
        tensors = moments.fit(layer_moments, consumer, same, ridge_rel, predicted=frozenset(models))
        for layer, model in models.items():
            tensors.update(predictor.to_tensors(layer, model))
        meta["predictor"] = {"config": reports[str(chosen[0])]["config"], "layers": reports, "patch_loss_linear": linear_loss}
        art = Artifact(tensors, meta)
        log(f"refitted with learned predictors on layers {chosen}")
    ev = search.LossEvaluator(art, producer, consumer, heldout)
    front, report = search.schedule_front(ev, g, loss_target, schedules=schedules, generations=generations, seed=seed, log=log)
    meta["schedules"] = search.entries(search.evenly_spaced(front, max_schedules))
    meta["search"] = report
    # the recompute baseline's span, chosen by profiling on the same held-out set (DroidSpeak-style):
    # the default width's best span, and the best span of narrower widths (powers of two: cheaper
    # baselines whose consumer compute is closer to SCD's)
    start, end = default_span(consumer.info.num_layers)
    if recompute_span is not None:  # given, as `schedules` replaces the search: no profile
        meta["recompute_span"] = list(recompute_span)
    elif same:  # recomputing from the true hidden state is exact for any span: keep the default
        meta["recompute_span"] = [start, end]
    else:
        profile = profile_span(  # every width up to the default's, in one pass over the held-out set
            producer,
            consumer,
            [h.context_ids for h in heldout],
            [h.qa_ids[: h.answer_start] for h in heldout],
            [h.qa_ids[h.answer_start :] for h in heldout],
            profile_widths(end - start),
        )
        best: dict[str, list[int]] = {}
        for row in profile:  # rows come best-first within each width
            best.setdefault(str(row["width"]), [row["start"], row["end"]])
        meta["recompute_span"] = best[str(end - start)]
        meta["recompute_spans"] = best
        meta["recompute_profile"] = profile
    meta["audit"] = audit_thresholds.thresholds(art, producer, consumer, heldout)  # the cache audit's calibrated thresholds
    meta["candidates"] = candidates.measure(art, producer, consumer, heldout, ev, log)  # raw, quant, recompute on this scale
    meta["calibration"]["wall_s"] = round(time.perf_counter() - started, 1)
    return art


def profile_widths(width: int) -> list[int]:
    """The span widths the recompute profile measures: 1, 2, 4, ... below `width`, and `width`
    (O(L log L) spans for L layers, where every width up to the default's would be O(L^2))."""
    widths, w = [], 1
    while w < width:
        widths.append(w)
        w *= 2
    return widths + [width]


def _predictor_layers(
    spec: str, art: Artifact, producer: LoadedModel, consumer: LoadedModel, heldout, loss_target: float, log
) -> tuple[list[int], dict[str, float]]:
    """(layers to give a predictor, Patch loss per layer with the linear map alone if measured)."""
    n = consumer.info.num_layers
    if spec == "none":
        return [], {}
    if spec == "all":
        return list(range(n)), {}
    auto, _, most = spec.partition(":")
    if auto != "auto":
        return sorted({int(x) for x in spec.split(",")}), {}
    ev = search.LossEvaluator(art, producer, consumer, heldout)
    losses = {l: ev.loss([Action("patch") if i == l else None for i in range(n)]) for l in range(n)}
    log(f"patch loss with the linear map alone, per layer: {losses}")
    over = sorted((l for l, v in losses.items() if v > loss_target), key=lambda l: -losses[l])
    return sorted(over[: int(most)] if most else over), {str(l): v for l, v in losses.items()}
