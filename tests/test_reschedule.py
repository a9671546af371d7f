"""calibration.reschedule: a new search over an artifact's own maps, on its own held-out examples."""

from __future__ import annotations

import json

import pytest
import torch

from calibration import corpus as corpus_lib
from calibration.distill import distill
from calibration.reschedule import main
from calibration.search import LossEvaluator
from shared.models import load_model
from shared.scd.artifact import Artifact
from shared.scd.schedule import Schedule
from tests.conftest import perturbed_model
from tests.test_scd import random_corpus


def test_rescheduling_keeps_the_tensors_searches_anew_and_refuses_another_corpus(tmp_path, capsys):
    perturbed_model("tiny-llama", seed=1, scale=0.05, save_to=tmp_path / "c")
    producer = load_model("tiny-llama", "float32", "cpu")
    consumer = load_model(str(tmp_path / "c"), "float32", "cpu")
    corpus_file = tmp_path / "corpus.jsonl"
    corpus_file.write_text("".join(json.dumps({"ids": ids}) + "\n" for ids in random_corpus(15, 96, 0)))
    corpus = corpus_lib.load(str(corpus_file), consumer.tokenizer, 12, 3)
    art = distill(producer, consumer, corpus.sequences, corpus.heldout, corpus_name=corpus.name, schedules=["R8.P.R8.R8"],
                  recompute_span=(1, 3), log=lambda m: None)  # fmt: skip
    art.save(tmp_path / "a.safetensors")
    flags = ["--artifact", str(tmp_path / "a.safetensors"), "--corpus", str(corpus_file), "--n", "12", "--heldout", "3"]
    # the consumer is found by the id the artifact names: a path here
    main([*flags, "--loss-target", "0.01", "--generations", "2", "--out", str(tmp_path / "b.safetensors")])
    new = Artifact.load(tmp_path / "b.safetensors")
    assert new.artifact_id != art.artifact_id and new.meta["search"]["from_artifact"] == art.artifact_id
    assert new.tensors.keys() == art.tensors.keys() and all(torch.equal(new.tensors[k], art.tensors[k]) for k in art.tensors)
    assert len(new.schedules) > 1 and "P8" in new.meta["search"]["lattice"]  # searched, not the one given schedule
    ev = LossEvaluator(new, producer, consumer, corpus.heldout)
    for e in new.schedules[:2]:  # each entry's loss is its schedule's on the artifact's own held-out examples
        assert e.loss == pytest.approx(ev.loss(Schedule.parse(e.schedule, 4).actions), rel=1e-6)
    assert set(new.meta["audit"]["heldout_max"]) == {e.schedule for e in new.schedules}
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["name"] for r in lines] == [e.name for e in new.schedules]
    main([*flags, "--schedules", "R2.P8.R2.R2", "--out", str(tmp_path / "c.safetensors")])
    assert [e.schedule for e in Artifact.load(tmp_path / "c.safetensors").schedules] == ["R2.P8.R2.R2"]
    with pytest.raises(SystemExit, match="--corpus: digest"):
        main([*flags[:-4], "--n", "11", "--heldout", "3", "--out", str(tmp_path / "d.safetensors")])
