"""The results documents from the committed rows: reading them (rows.py), every figure the
documents quote (figures.py; serving.py, verify.py, gpu.py per benchmark; projection.py),
and docs/results.md, the README's generated blocks and bench/results/quality.md from
bench/templates/ (report.py: `python -m bench.figures.report`, `--check` in the tests); ab.py
compares two sets of throughput rows.

May import: bench/harness/, the serving benchmarks' row formats and tables (bench/serving/: the
TTFT grid's plot, the audit's and quality's tables, adaptive's reading of its steps), shared, qa.
The serving benchmarks never import this package: they write the rows, it reads them.
"""
