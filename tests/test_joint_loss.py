"""calibration.joint_loss: every layer rebuilt one way, some left C's own, on the search's loss."""

from __future__ import annotations

from calibration.distill import distill
import pytest

from calibration.joint_loss import named_schedule, rows
from calibration.search import LossEvaluator
from shared.models import load_model
from shared.scd.schedule import Action, Schedule
from tests.conftest import perturbed_model
from tests.test_scd import heldout, random_corpus


def test_rows_rebuild_every_layer_but_the_ones_left_own(tmp_path):
    perturbed_model("tiny-llama", seed=1, scale=0.05, save_to=tmp_path)
    producer = load_model("tiny-llama", "float32", "cpu")
    consumer = load_model(str(tmp_path), "float32", "cpu")
    art = distill(producer, consumer, random_corpus(12, 96, 0), heldout(3, 1), corpus_name="random",
                  schedules=["R8.P.R8.R8"], log=lambda m: None)  # fmt: skip
    ev = LossEvaluator(art, producer, consumer, heldout(3, 2))
    schedule = Schedule.parse("R8.P.R8.R8", 4)
    got = rows(ev, 4, ["W", "P"], [[1], [0, 1, 2, 3]], [("s0", schedule, 123.0)], ([1],))
    assert [(r["rebuilt"], r["own"]) for r in got] == [
        ("W in every layer", []), ("W in every layer", [1]), ("W in every layer", [0, 1, 2, 3]), ("W only in 1", [0, 2, 3]),
        ("P in every layer", []), ("P in every layer", [1]), ("P in every layer", [0, 1, 2, 3]), ("P only in 1", [0, 2, 3]),
        ("schedule", []),
    ]  # fmt: skip
    assert got[3]["loss"] == ev.loss([None, Action("raw"), None, None]) > 0
    naive, one_own, all_own = (r["loss"] for r in got[:3])
    assert naive > 0 and all_own == 0.0  # every layer C's own is the oracle itself
    assert naive == ev.loss([Action("raw")] * 4) and one_own == ev.loss([Action("raw"), None, Action("raw"), Action("raw")])
    assert got[-1]["loss"] == ev.loss(schedule.actions) and got[-1]["schedule"] == "R8.P.R8.R8"
    assert got[-1]["name"] == "s0" and got[-1]["bytes_per_token"] == 123.0
    mine = rows(ev, 4, [], [[1]], [("s0", schedule, 123.0)], schedule_owns=True)  # where the schedule's loss sits
    assert [(r["name"], r["own"]) for r in mine] == [("s0", []), ("s0", [1])]
    assert mine[1]["loss"] == ev.loss([schedule.actions[0], None, *schedule.actions[2:]])
    # schedules by the artifact's name or by text (named when the artifact has that text)
    assert named_schedule(art, "s0", 4) == ("s0", schedule, art.schedules[0].bytes_per_token)
    assert named_schedule(art, "R8.P.R8.R8", 4)[0] == "s0"
    name, other, size = named_schedule(art, "R8.P8.R8.R8", 4)
    assert (name, str(other), size) == ("given", "R8.P8.R8.R8", other.bytes_per_token(art.geometry))
    assert named_schedule(art, "cheap=R8.P8.R8.R8", 4) == ("cheap", other, size)
    with pytest.raises(SystemExit, match="neither"):
        named_schedule(art, "s9", 4)


def test_a_given_recompute_span_skips_the_profile():
    from calibration.__main__ import build_parser, span

    args = build_parser().parse_args(["--producer", "p", "--consumer", "c", "--corpus", "x", "--out", "o", "--recompute-span", "13,21"])
    assert span(args.recompute_span) == (13, 21) and span("") is None
