"""The schedule search's cost grows linearly with depth (calibration.search.search): counted loss
evaluations on a 30-layer lattice, with a loss whose optimum is known (additive per layer), so a
search that measured every greedy step, or ran unbounded generations, fails here."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

from calibration import search
from shared.scd.schedule import Geometry, bytes_per_token


class AdditiveLoss:
    """loss(schedule) = sum over layers of a seeded per-(layer, action) term that falls as an
    action's bytes grow; None (C's own K/V) costs 0. Counts its calls."""

    def __init__(self, num_layers: int, lattice, g: Geometry, seed: int = 0):
        rng = random.Random(seed)
        self.consumer = SimpleNamespace(info=SimpleNamespace(num_layers=num_layers))
        weight = [rng.uniform(0.1, 2.0) for _ in range(num_layers)]
        top = max(bytes_per_token(a, g) for a in lattice)
        self.term = {
            (l, a): weight[l] * 1e-3 * (1 - bytes_per_token(a, g) / top) ** 2 for l in range(num_layers) for a in lattice
        }
        self.calls = 0

    def loss(self, actions) -> float:
        self.calls += 1
        return sum(self.term[(l, a)] for l, a in enumerate(actions) if a is not None)


def test_search_evaluations_grow_linearly_with_depth():
    g = Geometry(hidden=576, kv_width=384, kv_element_bytes=4)
    lattice = search.action_lattice(g, with_quant=True)
    for layers in (6, 30):
        ev = AdditiveLoss(layers, lattice, g)
        front, report = search.search(ev, lattice, g, loss_target=2e-3, log=lambda m: None)
        path = report["greedy_path_length"]
        assert path > layers  # a long path: measuring every step would cost > L evaluations more
        bound = layers * len(lattice) + 8 + math.ceil(math.log2(path)) + 1 + max(48, 4 * layers)
        assert ev.calls <= bound, (layers, ev.calls, bound, report["evaluations"])
        assert report["evaluations"]["sensitivity"] == layers * len(lattice)
        assert report["evaluations"]["greedy"] <= 8 + math.ceil(math.log2(path)) + 1
        meeting = [p for p in front if p.loss <= 2e-3]
        assert meeting, "the search must find a schedule within the target"
        # the loss is additive, so it falls along the greedy path: the bisection must find the
        # path's cheapest schedule within the target (or the evolution something cheaper)
        sens = {(l, a): ev.term[(l, a)] for l in range(layers) for a in lattice}
        walk = search.greedy_path(sens, lattice, g, layers)
        first = next(actions for actions in walk if ev.loss(actions) <= 2e-3)
        want = sum(bytes_per_token(a, g) for a in first)
        assert min(p.bytes_per_token for p in meeting) <= want + 1e-9
