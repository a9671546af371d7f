"""What a layer's SCD encoder reads on the producer: P's normalized layer input, seen through a
causal window of neighbouring tokens, or through the layer's learned predictor where the
artifact has one. The serving path (shared.scd.ops) and calibration (which fits the linear maps
on these same features) both call `producer_features`, so calibrated and served codes agree.
"""

from __future__ import annotations

import torch

from shared.scd.predictor import predict


def windowed(x: torch.Tensor, window: int) -> torch.Tensor:
    """Causal window of a token's state: [T, d] -> [T, window * d], row t = [x_t, x_{t-1}, ...],
    zeros before the first token. The encoder and the patch predictor read P's state through it,
    so a consumer feature that P carries at a neighbouring token (e.g. a fine-tune that shifted
    a previous-token head) is still linearly reachable."""
    if window == 1:
        return x
    shifted = [torch.cat([x.new_zeros(k, x.shape[1]), x[: x.shape[0] - k]]) for k in range(window)]
    return torch.cat(shifted, dim=1)


@torch.no_grad()
def producer_features(xp: torch.Tensor, window: int, predictor=None) -> torch.Tensor:
    """What a layer's linear encoder and patch map read: the learned predictor's output
    (shared.scd.predictor) where the layer has one, else P's windowed state. xp: [T, d]."""
    if predictor is not None:
        return predict(predictor, xp)
    return windowed(xp, window)
