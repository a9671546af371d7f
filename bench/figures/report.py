"""`python -m bench.figures.report` (`make results-doc`): docs/results.md, the README's generated
blocks and bench/results/quality.md, from the templates in bench/templates/ and the figures bench.figures.figures computes from the
committed rows. `--check` writes nothing and fails (exit 1, with a diff) when a committed document
differs from what the rows give; tests/test_results_doc.py runs it in `make test`.

Templates are Python format strings read with `str.format_map` over the figures:
`{q[heterogeneous][first][head][f1]:.1f}` is the headline row's F1 of that pair with one decimal.
Literal braces are written `{{` and `}}`. A README block is the text between
`<!-- generated:NAME -->` and `<!-- /generated:NAME -->`, filled from bench/templates/readme_NAME.md;
a block whose opening marker ends its line is a block of lines, otherwise it sits inside a line.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

from bench.figures.figures import ROOT, figures

TEMPLATES = Path(__file__).parents[1] / "templates"
RESULTS_DOC = "docs/results.md"
README = "README.md"
QUALITY_TABLE = "bench/results/quality.md"
BLOCK = re.compile(r"(<!-- generated:([a-z_]+) -->)(.*?)(<!-- /generated:\2 -->)", re.S)


def render(template: str, values: dict) -> str:
    return template.format_map(values)


def fill_blocks(text: str, values: dict, templates: Path = TEMPLATES) -> str:
    """`text` with every generated block replaced by its rendered template."""

    def block(match: re.Match) -> str:
        opening, name, _, closing = match.groups()
        body = render((templates / f"readme_{name}.md").read_text(), values)
        inline = not text[match.end(1) : match.end(1) + 1] == "\n"
        body = body.rstrip("\n") if inline else "\n" + body.strip("\n") + "\n"
        return opening + body + closing

    return BLOCK.sub(block, text)


def documents(root: Path = ROOT) -> dict[str, str]:
    """{repo-relative path: the text the rows give}."""
    values = figures(root)
    return {
        RESULTS_DOC: render((TEMPLATES / "results.md").read_text(), values),
        README: fill_blocks((root / README).read_text(), values),
        QUALITY_TABLE: values["q"]["table"] + "\n",  # what bench.serving.quality writes, from the same rows
    }


def stale(root: Path = ROOT) -> dict[str, str]:
    """{path: unified diff} of every committed document that differs from what the rows give."""
    out = {}
    for path, text in documents(root).items():
        committed = (root / path).read_text()
        if committed != text:
            out[path] = "".join(difflib.unified_diff(committed.splitlines(True), text.splitlines(True), path, "generated"))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.figures.report", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a document is stale")
    args = p.parse_args(argv)
    if args.check:
        diffs = stale()
        for diff in diffs.values():
            sys.stdout.write(diff)
        if diffs:
            sys.exit(f"stale: {', '.join(diffs)} (run `make results-doc`)")
        return
    for path, text in documents().items():
        (ROOT / path).write_text(text)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
