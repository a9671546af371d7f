"""The results documents are generated from the committed rows (`make results-doc`,
bench.report): docs/results.md and the README's generated blocks must equal what the rows give,
and the counts they quote come from the source they count."""

from __future__ import annotations

from bench import figures, report


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
