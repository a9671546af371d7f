"""real.quality's offline answers are the services' answers, on the real pair.

real.quality scores every transfer mode offline (one prefill per side per example, each mode's
cache rebuilt through calibration.candidates.codec_kv); its claim is that the producer and
consumer services give the same answers. Here: a small SCD artifact for P = smollm2-135m ->
C = smollm2-135m-tuned (given schedules, no search, a given recompute span, no profile), the real
services on loopback ports with it, and real.tasks test examples (~384 tokens of context) asked as
token ids in modes raw (naive reuse), scd with each schedule, quant at 4 bits, recompute and
oracle, and raw and scd with the committed learned keep policy at 25 % (the producer scores its own
prefill with artifacts/smollm2-pc.keep.safetensors), greedy up to `<|im_end|>`; each answer's text must be real.quality.answers' for the same
mode. Where the two differ, the only excuse is a near tie (tests/greedy.py): the offline greedy's
top-2 logits at the first differing token within NEAR_TIE, where the services' kernels (their
engine's chunked prefill and paged attention) may round the other way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from calibration.distill import distill
from qa.predict import prefill
from real import corpus as real_corpus
from real import quality, tasks
from shared.keep import distill as keep_distill
from shared.models import load_model
from shared.pb import common_pb2
from tests.conftest import prompt, running_pair
from tests.greedy import NEAR_TIE

PRODUCER, CONSUMER, LAYERS = "smollm2-135m", "smollm2-135m-tuned", 30
SCHEDULES = (
    ".".join(["R64"] * LAYERS),  # Reuse at rank 64 on every layer
    ".".join(["R32", "P", "W"] * (LAYERS // 3)),  # Reuse, Patch and raw (W) in turn
)
EXAMPLES = (("niah_single", 0), ("qa", 1))  # (family, test index)
CONTEXT_TOKENS, MAX_NEW = 384, 24
RECOMPUTE_SPAN = (14, 22)  # the default width's span the profile chose on this held-out example (given: no profile)
# the services' mode (codec name, options) and real.quality's label for it
MODES = [
    ("raw", {}, "naive"),
    *(("scd", {"schedule": s}, f"scd:{s}") for s in SCHEDULES),
    ("quant", {"bits": "4"}, "quant:4"),
    ("recompute", {"start": str(RECOMPUTE_SPAN[0]), "end": str(RECOMPUTE_SPAN[1])}, "recompute"),
    ("oracle", {}, "oracle"),
    # the committed learned keep policy (artifacts/smollm2-pc.keep.safetensors), scored by the producer
    ("raw", {"keep": "distill:0.25"}, "naive@distill:0.25"),
    ("scd", {"schedule": SCHEDULES[1], "keep": "distill:0.25"}, f"scd:{SCHEDULES[1]}@distill:0.25:heads=shared"),
]
KEEP_WEIGHTS = Path(__file__).resolve().parent.parent / "artifacts" / "smollm2-pc.keep.safetensors"


@pytest.fixture(scope="module")
def threads():
    """One torch thread for the models here and the in-process services (a busy 2-core host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def calibrated(threads, tmp_path_factory):
    """(P, C, artifact, the directory holding it): 2 calibration sequences, 1 held out."""
    producer = load_model(PRODUCER, "float32", "cpu")
    consumer = load_model(CONSUMER, "float32", "cpu")
    assert consumer.info.num_layers == LAYERS
    corpus = real_corpus.calibration_corpus(consumer.tokenizer, n=2, heldout=1, ctx="256")
    art = distill(producer, consumer, corpus.sequences, corpus.heldout, corpus_name=corpus.name,
                  schedules=list(SCHEDULES), recompute_span=RECOMPUTE_SPAN, log=lambda m: None)
    assert art.meta["recompute_span"] == list(RECOMPUTE_SPAN) and "recompute_profile" not in art.meta
    directory = tmp_path_factory.mktemp("artifacts")
    art.save(directory / "smollm2-pc.safetensors")
    shutil.copy(KEEP_WEIGHTS, keep_distill.weights_path(directory / "smollm2-pc.safetensors"))  # the producer loads it
    keep_distill.register(directory / "smollm2-pc.safetensors")  # and real.quality's "distill" reads the same file
    return producer, consumer, art, directory


@torch.inference_mode()
def offline_ids_and_margins(consumer, cache, question_ids: list[int], stop: int) -> tuple[list[int], list[float]]:
    """real.reuse_gap.answer's greedy (qa.predict.prefill, stop token included here) with each
    position's top-2 logit gap; extends `cache`."""
    logits, cache = prefill(consumer.model, torch.tensor([question_ids]), cache)
    ids, margins = [], []
    for _ in range(MAX_NEW):
        top = torch.topk(logits[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax(-1)))
        if ids[-1] == stop:
            break
        logits, cache = prefill(consumer.model, torch.tensor([[ids[-1]]]), cache)
    return ids, margins


def near_tie_note(producer, consumer, modes, example, label: str, served: list[int]) -> str:
    """Why the services' tokens may differ from the offline greedy's: '' when the first
    difference is no near tie (a failure), else where it is."""
    stop = tasks.end_id(consumer.tokenizer)
    cache = dict(quality.mode_caches(producer, consumer, modes, example.context_ids))[label]
    offline, margins = offline_ids_and_margins(consumer, cache, example.question_ids, stop)
    split = next((i for i, (a, b) in enumerate(zip(served, offline)) if a != b), None)
    if split is None or margins[split] >= NEAR_TIE:
        return ""
    return f"near tie at token {split}: offline top-2 margin {margins[split]:.2g} < {NEAR_TIE}"


@pytest.mark.numeric
async def test_services_answer_as_real_quality_scores_offline(calibrated):
    producer, consumer, art, directory = calibrated
    tok = consumer.tokenizer
    stop = tasks.end_id(tok)
    modes = quality.Modes(art, producer, consumer, [label for _, _, label in MODES])
    examples = [tasks.make(tok, family, "test", index, CONTEXT_TOKENS) for family, index in EXAMPLES]
    offline = [quality.answers(producer, consumer, modes, ex, MAX_NEW) for ex in examples]
    served: list[dict[str, tuple[list[int], str]]] = [{} for _ in examples]
    kw = {"artifacts": str(directory)}
    async with running_pair(PRODUCER, consumer_model=CONSUMER, producer_kw=kw, consumer_kw=kw) as pair:
        for ex, out in zip(examples, served):
            for codec, options, label in MODES:
                ids, text, stats = await pair.generate(
                    context=prompt(ids=ex.context_ids), question=prompt(ids=ex.question_ids), max_new_tokens=MAX_NEW,
                    stop_token_ids=[stop], transfer=common_pb2.CodecSpec(name=codec, options=options))
                assert stats.transfer.name == codec and stats.context_tokens == len(ex.context_ids), label
                asked = {k: v for k, v in options.items() if k != "keep"}
                assert {k: stats.transfer.options[k] for k in asked} == asked, label
                assert stats.transfer.options.get("keep", "").startswith(options.get("keep", "")), label
                out[label] = ids, text.strip()  # the services' text skips special tokens; the stop token is the one here
    failures, ties = [], []
    for ex, said, ids_by_mode in zip(examples, offline, served):
        for _, _, label in MODES:
            ids, text = ids_by_mode[label]
            print(f"{ex.family} #{ex.seed} {label[:24]}: {text!r} (gold {ex.answer!r})")
            if text == said[label]:
                continue
            where = f"{ex.family} #{ex.seed}, mode {label}: services {text!r}, offline (real.quality) {said[label]!r}"
            if tok.decode(ids[:-1] if ids and ids[-1] == stop else ids).strip() == said[label]:  # as real.reuse_gap.answer
                failures.append(f"{where} (the same tokens: the texts differ in special tokens)")
                continue
            note = near_tie_note(producer, consumer, modes, ex, label, ids)
            (ties if note else failures).append(f"{where} ({note or 'no near tie'})")
    for line in ties:
        print(line)
    assert not failures, "\n".join(failures)
    assert len(ties) < len(examples) * len(MODES), "every answer differed, each at a near tie: " + "\n".join(ties)


def test_oracle_only_runs_read_the_pairs_summary_where_its_tensors_are_not_built(tmp_path):
    """real.quality's oracle modes (C's own cache, a selection or not) read no artifact tensor: the
    committed summary beside an unbuilt artifact stands in and names it; a mode that sends codes
    still needs the tensors (the error names the file)."""
    import json
    import shutil
    from pathlib import Path

    summary = Path(__file__).resolve().parents[1] / "artifacts" / "smollm2-pc.json"
    shutil.copy(summary, tmp_path / "pair.json")
    art = quality.pair_artifact(tmp_path / "pair.safetensors", ["oracle", "oracle@streaming:0.25"])
    assert art.artifact_id == json.loads(summary.read_text())["artifact_id"] and not art.tensors
    with pytest.raises(Exception, match="pair.safetensors"):
        quality.pair_artifact(tmp_path / "pair.safetensors", ["oracle", "naive"])


def test_an_index_asks_the_same_example_whatever_the_runs_first_index():
    """A run resumed at --first N asks what a whole run asks at those indices (families in turn
    by index, not by position in the run)."""
    tok = load_model(CONSUMER, "float32", "cpu").tokenizer
    whole = tasks.examples(tok, "test", 8, 1024)
    resumed = tasks.examples(tok, "test", 5, 1024, first=3)
    assert [(e.seed, e.family, e.answers) for e in resumed] == [(e.seed, e.family, e.answers) for e in whole[3:]]


def test_summarize_joins_runs_over_overlapping_ranges_counting_each_example_once(tmp_path):
    """The committed 4096-token run's rows cut in two parts that overlap by two examples (as a
    resumed run's are), joined in one file: the summaries are the whole run's."""
    committed = Path(__file__).resolve().parent.parent / "bench/results/real/keep-pc-4096-probe.jsonl"
    lines = [json.loads(line) for line in committed.read_text().splitlines() if line.strip()]
    tasks_rows = [r for r in lines if r["kind"] == "task"]
    want = {r["mode"]: r for r in lines if r["kind"] == "summary"}
    seeds = list(dict.fromkeys(r["seed"] for r in tasks_rows))
    cut = len(seeds) // 2
    first = [r for r in tasks_rows if r["seed"] in seeds[: cut + 2]]
    second = [r for r in tasks_rows if r["seed"] in seeds[cut:]]
    joined = tmp_path / "joined.jsonl"
    joined.write_text("".join(json.dumps(r) + "\n" for r in first + second))
    quality.summarize(joined)
    got = {r["mode"]: r for r in map(json.loads, joined.read_text().splitlines()) if r["kind"] == "summary"}
    assert set(got) == set(want)
    for mode, summary in want.items():
        assert got[mode]["n"] == summary["n"] == len(seeds), mode
        assert got[mode]["f1"] == summary["f1"] and got[mode]["f1_gap_ci95"] == summary["f1_gap_ci95"], mode
