"""The results documents are generated from the committed rows (`make results-doc`,
bench.figures.report): docs/results.md and the README's generated blocks must equal what the rows give,
and the counts they quote come from the source they count."""

from __future__ import annotations

from bench.figures import figures, report


def test_committed_documents_equal_what_the_rows_give():
    stale = report.stale()
    assert stale == {}, "run `make results-doc`:\n" + "\n".join(stale.values())[:4000]


def test_the_contract_case_count_is_the_hostile_tests_own():
    from tests.test_hostile_producer import CASES

    assert figures.contract()["hostile_cases"] == len(CASES)


def test_blocks_are_filled_inline_or_as_lines(tmp_path):
    (tmp_path / "readme_one.md").write_text("{x[n]} cases\n")
    (tmp_path / "readme_two.md").write_text("* {x[n]:.1f}\n")
    text = (
        "drives <!-- generated:one -->old<!-- /generated:one --> of them\n<!-- generated:two -->\nold\n<!-- /generated:two -->\n"
    )
    out = report.fill_blocks(text, {"x": {"n": 33}}, tmp_path)
    assert out == (
        "drives <!-- generated:one -->33 cases<!-- /generated:one --> of them\n"
        "<!-- generated:two -->\n* 33.0\n<!-- /generated:two -->\n"
    )
    assert report.fill_blocks(out, {"x": {"n": 33}}, tmp_path) == out  # idempotent


def test_figures_quote_what_the_rows_say():
    ttft = figures.ttft()
    rows = figures.rows_of(figures.RESULTS / "ttft.jsonl")
    assert ttft["max_efficiency"] == max(r["efficiency"] for r in rows if r["efficiency"] is not None)
    assert all(r["weights"] == "random" for r in rows if r["model"].endswith("-random"))
    assert all(r.get("derived") is True and r["formula"] for r in rows if r["mode"] == "cached")
    quality = figures.rows_of(figures.RESULTS / "quality.jsonl")
    assert all({"weights", "selected_on", "f1_ci95", "n"} <= set(r) for r in quality)


def test_throughput_cells_take_the_latest_run_and_the_median_of_its_repetitions(tmp_path):
    """bench.serving.throughput rows: a cell's figures come from its latest run only (every repetition of
    it, medians), or for rows written before runs had ids, from the last pair written."""
    import json

    from bench.figures import serving as service_figures

    def row(mb, tok, run=None, rep=0, mode="raw"):
        r = {"model": "m", "weights": "trained", "dtype": "float32", "torch_threads": 1, "mode": mode, "output": "long",
             "concurrency": 32, "max_batch": mb, "output_tokens_per_s": tok, "requests_per_s": tok / 64,
             "ttft_p50_ms": 10.0, "ttft_p95_ms": 20.0, "forward_ceiling_tokens_per_s": 1000.0,
             "identical_to_batch1_rate": 1.0, "load_avg_1m": 1.0}
        if run is not None:
            r.update(run=run, rep=rep)
        return r

    rows = [row(1, 100), row(64, 900),  # legacy pair, replaced by the run below
            row(1, 100, "a", 0), row(64, 300, "a", 0), row(64, 500, "a", 1), row(1, 100, "a", 1),
            row(1, 100, "a", 2), row(64, 400, "a", 2),
            row(1, 50, mode="scd"), row(64, 100, mode="scd"), row(1, 100, mode="scd"), row(64, 400, mode="scd")]
    (tmp_path / "bench/results").mkdir(parents=True)
    (tmp_path / "bench/results/throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = service_figures.throughput(tmp_path)
    raw, scd = out["cells"]["m|1|raw|long|32"], out["cells"]["m|1|scd|long|32"]
    assert raw["runs"] == 3 and raw["tok"] == 4.0 and raw["tok_range"] == "3.0-5.0" and raw["ceiling"] == 0.4
    assert scd["runs"] == 1 and scd["tok"] == 4.0  # the last legacy pair
    assert "4.0x (3.0x-5.0x)" in out["table"]


def test_engine_process_cells_stand_apart_and_compare_with_one_process(tmp_path):
    """Rows of consumers run with --engine-process form their own cells ("1p"), labelled in the
    table, and each is compared with the same cell run in one process."""
    import json

    from bench.figures import serving as service_figures

    def row(mb, tok, split, ttft):
        return {"model": "m", "weights": "trained", "dtype": "float32", "torch_threads": 1, "mode": "raw", "output": "long",
                "concurrency": 32, "max_batch": mb, "output_tokens_per_s": tok, "requests_per_s": tok / 64,
                "ttft_p50_ms": ttft, "ttft_p95_ms": 20.0, "forward_ceiling_tokens_per_s": 1000.0,
                "identical_to_batch1_rate": 1.0, "load_avg_1m": 1.0, "engine_process": split, "run": "a", "rep": 0}

    rows = [row(1, 100, False, 10.0), row(64, 400, False, 10.0), row(1, 150, True, 10.0), row(64, 600, True, 5.0)]
    (tmp_path / "bench/results").mkdir(parents=True)
    (tmp_path / "bench/results/throughput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = service_figures.throughput(tmp_path)
    one, split = out["cells"]["m|1|raw|long|32"], out["cells"]["m|1p|raw|long|32"]
    assert one["tok"] == 4.0 and split["tok"] == 4.0 and "vs_one_process_tok" not in one
    assert split["vs_one_process_tok"] == 1.5 and split["vs_one_process_ttft"] == 0.5
    assert "(trained, float32, 1, engine process)" in out["table"]


def test_verify_speed_pairs_runs_within_each_invocation():
    from bench.figures.verify import _paired, _runs_of

    def r(policy: str, each: list[float] | None) -> dict:
        return {"policy": policy, **({"completion_ms_each": each} if each is not None else {})}

    rows = [
        r("raw", None), r("quant+verify", None),  # an invocation before per-run times: left out
        r("raw", [100.0, 200.0]), r("oracle", [50.0, 60.0]), r("quant+verify", [90.0, 220.0]),
        r("quant+verify", [80.0]), r("raw", [100.0]),  # another invocation, another order
    ]
    groups = _runs_of(rows)
    assert [sorted(g) for g in groups] == [["quant+verify", "raw"], ["oracle", "quant+verify", "raw"], ["quant+verify", "raw"]]
    paired = _paired(groups)
    assert paired["n"] == 3 and paired["below"] == 2 and paired["invocations"] == 2
    assert paired["lo"] == 0.8 and paired["hi"] == 1.1 and paired["median"] == 0.9
    assert _paired(groups[:1])["n"] == 0
