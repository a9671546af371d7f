"""Loss-constrained schedule search.

Loss of a schedule = mean KL(oracle || reconstructed) of the consumer's next-token distributions
over held-out answer tokens (teacher forcing), where "oracle" is C prefilling the context itself
and "reconstructed" is C attending over the cache the schedule rebuilds, through the same
`shared.scd.ops` code the services run, and the one KL of `calibration.kl`. Search: per-layer
sensitivities, a greedy path of upgrades by marginal loss per byte (walked on the sensitivities,
measured at a few points), then an evolutionary refinement over the layer x action lattice
seeded from the measured front, under an evaluation budget; the result is the Pareto set (bytes
per token vs measured loss). Its cost grows linearly with depth (see `search`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from calibration.kl import kl_sum, scored_logprobs
from shared import kv, layers
from shared.models import LoadedModel
from shared.scd import ops
from shared.scd.artifact import Artifact
from shared.scd.schedule import Action, Geometry, Schedule, bytes_per_token


@dataclass(frozen=True)
class HeldOut:
    context_ids: list[int]
    qa_ids: list[int]  # question then answer tokens
    answer_start: int  # index in qa_ids of the first answer token


class LossEvaluator:
    """Caches each (example, layer, action) reconstruction; a schedule's loss is then a short
    teacher-forced forward of C per example."""

    def __init__(self, art: Artifact, producer: LoadedModel, consumer: LoadedModel, heldout: Sequence[HeldOut]):
        self.art, self.producer, self.consumer, self.heldout = art.to(producer.device), producer, consumer, list(heldout)
        self.states: list[dict[int, kv.LayerState]] = []
        self.oracle_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self.oracle_logp: list[torch.Tensor] = []
        self.memo: dict[tuple[int, int, Action], tuple[torch.Tensor, torch.Tensor]] = {}
        for ex in self.heldout:
            states, _ = kv.capture_states(producer, ex.context_ids, kv.Capture.KV | kv.Capture.NORMED)
            self.states.append(states)
            own, _ = kv.capture_states(consumer, ex.context_ids, kv.Capture.KV)
            self.oracle_kv.append([own[i].kv() for i in range(consumer.info.num_layers)])
            self.oracle_logp.append(self._answer_logp(ex, self.oracle_kv[-1]))
        self.evaluations = 0

    @torch.inference_mode()
    def _answer_logp(self, ex: HeldOut, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """C's log-probs of the answer tokens, [A, vocab], on top of the context in layer_kv."""
        return scored_logprobs(self.consumer, layer_kv, [(ex.qa_ids, ex.answer_start)], len(ex.context_ids))[0]

    def layer_kv(self, index: int, layer: int, action: Action | None) -> tuple[torch.Tensor, torch.Tensor]:
        if action is None:
            return self.oracle_kv[index][layer]
        key = (index, layer, action)
        if key not in self.memo:
            state = self.states[index][layer]
            payloads = {n: t.detach().cpu().contiguous() for n, t in ops.encode_layer(self.art, layer, action, state).items()}
            pos = layers.positions(self.consumer, len(self.heldout[index].context_ids))
            self.memo[key] = ops.decode_layer(self.art, layer, action, payloads, self.consumer, pos)
        return self.memo[key]

    def loss(self, actions: Sequence[Action | None]) -> float:
        """Mean KL over held-out answer tokens; None in a layer means C's own (oracle) K/V."""
        self.evaluations += 1
        return self.mean_kl(lambda index: [self.layer_kv(index, l, a) for l, a in enumerate(actions)])

    def mean_kl(self, rebuilt: Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]) -> float:
        """Mean KL(oracle || C on rebuilt(index)) over every held-out answer token, where
        rebuilt(index) is example index's context cache, per layer (keys, values) [n_kv, T, hd]
        post-RoPE, or [n_kv, n, hd] of n kept tokens (a keep set, at their original positions):
        the loss of any way of rebuilding the cache (a schedule, another codec, a keep set)."""
        total, count = 0.0, 0
        for index, ex in enumerate(self.heldout):
            logp = self._answer_logp(ex, rebuilt(index))
            total += float(kl_sum(self.oracle_logp[index], logp))
            count += logp.shape[0]
        return max(0.0, total / max(count, 1))  # KL >= 0; float error can dip below


def action_lattice(g: Geometry, with_quant: bool) -> list[Action]:
    ranks, r = [], 2
    while r < g.kv_width:
        ranks.append(r)
        r *= 2
    ranks.append(g.kv_width)
    lattice = [Action("reuse", r) for r in ranks] + [Action("patch", 8), Action("patch"), Action("raw")]
    if with_quant:
        lattice += [Action("quant", 4), Action("quant", 8)]
    return sorted(lattice, key=lambda a: bytes_per_token(a, g))


@dataclass
class Point:
    schedule: Schedule
    bytes_per_token: float
    loss: float


def pareto(points: list[Point]) -> list[Point]:
    """Non-dominated points (fewer bytes or lower loss), sorted by bytes."""
    front, best = [], float("inf")
    for p in sorted(points, key=lambda p: (p.bytes_per_token, p.loss)):
        if p.loss < best - 1e-12:
            front.append(p)
            best = p.loss
    return front


def entries(front: list[Point]) -> list[dict]:
    """An artifact's schedule entries (its metadata's "schedules"): s0, s1, ... in front order."""
    return [
        {"name": f"s{i}", "schedule": str(p.schedule), "loss": p.loss, "bytes_per_token": p.bytes_per_token}
        for i, p in enumerate(front)
    ]


def evenly_spaced(items: list, n: int) -> list:
    """At most n items: both ends and an even spread between (items kept in order)."""
    if len(items) <= n:
        return list(items)
    if n <= 1:
        return list(items[-1:]) if n == 1 else []
    step = (len(items) - 1) / (n - 1)
    return [items[round(i * step)] for i in range(n)]


def greedy_path(
    sens: dict[tuple[int, Action], float], lattice: list[Action], g: Geometry, num_layers: int
) -> list[tuple[Action, ...]]:
    """Schedules from the cheapest action everywhere, each one upgrade further, chosen by the best
    marginal gain of the per-layer sensitivities (loss drop / extra byte): an additive model of
    the loss, computed without a forward. Bytes grow along the path."""
    current = [lattice[0]] * num_layers
    path = [tuple(current)]
    while True:
        best, choice = 0.0, None
        for l in range(num_layers):
            for a in lattice:
                extra = bytes_per_token(a, g) - bytes_per_token(current[l], g)
                gain = sens[(l, current[l])] - sens[(l, a)]
                if extra > 0 and gain > 0 and gain / extra > best:
                    best, choice = gain / extra, (l, a)
        if choice is None:
            return path
        current[choice[0]] = choice[1]
        path.append(tuple(current))


def search(
    ev: LossEvaluator,
    lattice: list[Action],
    g: Geometry,
    loss_target: float,
    generations: int = 30,
    population: int = 16,
    patience: int = 6,
    seed: int = 0,
    path_points: int = 8,
    evo_budget: int | None = None,
    log=print,
) -> tuple[list[Point], dict]:
    """The Pareto set of schedules found, and a report of what the search did.

    Cost in loss evaluations (each a teacher-forced forward of C per held-out example), for L
    layers and A actions: L x A sensitivities; then the greedy path is walked without a forward
    (additive sensitivities) and measured only at `path_points` evenly spaced schedules plus a
    bisection for the cheapest one within loss_target (O(log(L x A))); then the evolutionary
    refinement spends at most `evo_budget` evaluations (default max(48, 4 L)). Linear in depth:
    a 30-layer pair costs ~17 L evaluations, not the ~2 L A + 480 of measuring every greedy step
    and 30 full generations."""
    num_layers = ev.consumer.info.num_layers
    seen: dict[str, Point] = {}
    counts = {"sensitivity": 0, "greedy": 0, "evolution": 0}
    wall: dict[str, float] = {}
    clock = time.perf_counter()

    def measure(actions: tuple[Action, ...], stage: str) -> Point:
        s = Schedule(actions)
        if str(s) not in seen:
            seen[str(s)] = Point(s, s.bytes_per_token(g), ev.loss(actions))
            counts[stage] += 1
        return seen[str(s)]

    # 1. sensitivities: only layer l approximated, the others C's own K/V
    sens = {}
    for l in range(num_layers):
        for a in lattice:
            sens[(l, a)] = ev.loss([a if i == l else None for i in range(num_layers)])
            counts["sensitivity"] += 1
    wall["sensitivity"], clock = time.perf_counter() - clock, time.perf_counter()
    # 2. greedy path from the sensitivities, measured at a few points and bisected for the target
    path = greedy_path(sens, lattice, g, num_layers)
    for actions in evenly_spaced(path, path_points):
        measure(actions, "greedy")
    lo, hi = 0, len(path) - 1
    if measure(path[hi], "greedy").loss <= loss_target:
        while lo < hi:  # the cheapest path point within the target, if the loss falls along the path
            mid = (lo + hi) // 2
            if measure(path[mid], "greedy").loss <= loss_target:
                hi = mid
            else:
                lo = mid + 1
    wall["greedy"], clock = time.perf_counter() - clock, time.perf_counter()
    log(f"greedy: path of {len(path)} schedules, {counts['greedy']} measured, front {len(pareto(list(seen.values())))}")
    # 3. evolutionary refinement seeded from the measured front, within its evaluation budget
    rng = random.Random(seed)
    budget = max(48, 4 * num_layers) if evo_budget is None else evo_budget

    def cheapest_meeting() -> float:
        ok = [p.bytes_per_token for p in seen.values() if p.loss <= loss_target]
        return min(ok) if ok else float("inf")

    best_bytes, stale, gen = cheapest_meeting(), 0, -1
    for gen in range(generations):
        if counts["evolution"] >= budget:
            break
        front = pareto(list(seen.values()))
        for _ in range(population):
            if counts["evolution"] >= budget:
                break
            parent = list(rng.choice(front).schedule.actions)
            for _ in range(rng.choice((1, 1, 2))):
                l = rng.randrange(num_layers)
                i = lattice.index(parent[l])
                parent[l] = lattice[max(0, min(len(lattice) - 1, i + rng.choice((-2, -1, 1, 2))))]
            measure(tuple(parent), "evolution")
        now = cheapest_meeting()
        stale = stale + 1 if now >= best_bytes else 0
        best_bytes = min(best_bytes, now)
        log(
            f"evo gen {gen}: evaluated {len(seen)}, front {len(pareto(list(seen.values())))}, "
            f"cheapest with loss <= {loss_target}: {best_bytes} B/token"
        )
        if best_bytes < float("inf") and stale >= patience:
            break
    wall["evolution"] = time.perf_counter() - clock
    report = {
        "wall_s": {k: round(v, 1) for k, v in wall.items()},
        "sensitivity": {f"{l}:{a}": v for (l, a), v in sens.items()},
        "evaluated": len(seen),
        "evaluations": dict(counts),
        "evo_budget": budget,
        "generations": gen + 1,
        "greedy_path_length": len(path),
        "greedy_path": [str(Schedule(a)) for a in evenly_spaced(path, path_points)],
    }
    return pareto(list(seen.values())), report


def schedule_front(
    ev: LossEvaluator,
    g: Geometry,
    loss_target: float,
    *,
    schedules: list[str] | None = None,
    generations: int = 30,
    seed: int = 0,
    log=print,
) -> tuple[list[Point], dict]:
    """The schedules an artifact offers and the report that says how they were found: `schedules`
    (texts) measured as given, cheapest first, or else the search over the lattice with the
    quantized actions."""
    if schedules:
        given = [Schedule.parse(text, ev.art.num_layers) for text in schedules]
        points = [Point(s, s.bytes_per_token(g), ev.loss(s.actions)) for s in given]
        return sorted(points, key=lambda p: p.bytes_per_token), {"given": [str(s) for s in given]}
    return search(ev, action_lattice(g, with_quant=True), g, loss_target, generations=generations, seed=seed, log=log)
