"""The consumer's parts import one way (issue 45), read from the source with tests/test_layering.py's
reader (every import, also inside functions and under TYPE_CHECKING):

- a consumer module imports its own part or one listed before it in consumer/__init__.py's
  docstring (engine/ first, the composition root server.py last), never one listed after it;
- every consumer module belongs to a listed part;
- the two fronts do not import each other (gRPC: consumer/api/servicer.py and what only it uses;
  HTTP: consumer/api/openai_*.py): the composition root wires both;
- bench/harness/ imports no other bench package, bench/micro/ only bench/harness/; bench/serving/
  writes rows and never imports bench/figures/, which reads them (and may import serving's row
  formats and tables): the two import one way (bench/__init__.py).
"""

from __future__ import annotations

import ast
import re

from tests.test_layering import ROOT, graph

GRPC_FRONT = ("consumer.api.servicer", "consumer.api.job_builder", "consumer.api.messages")
HTTP_FRONT = "consumer.api.openai_"
ROOTS = ("server", "__main__")  # the composition root: above every part


def declared_parts() -> list[str]:
    """The parts as consumer/__init__.py lists them, lowest first."""
    doc = ast.get_docstring(ast.parse((ROOT / "consumer/__init__.py").read_text())) or ""
    return re.findall(r"^    (\w+)(?:/|\.py)", doc, re.M)


def rank(module: str, parts: list[str]) -> int | None:
    """The module's place in the order (None: it belongs to no listed part)."""
    pieces = module.split(".")
    if pieces == ["consumer"]:
        return -1  # the package's own docstring
    part = pieces[1]
    if part in ROOTS:
        return len(parts)
    return parts.index(part) if part in parts else None


def order_violations(edges: dict[str, list[tuple[int, str]]], parts: list[str]) -> list[str]:
    bad = []
    for module, imported in sorted(edges.items()):
        if not module.startswith("consumer"):
            continue
        own = rank(module, parts)
        if own is None:
            bad.append(f"{module} belongs to no part listed in consumer/__init__.py")
            continue
        for line, target in imported:
            if not target.startswith("consumer"):
                continue
            other = rank(target, parts)
            if other is not None and other > own:
                bad.append(f"{module}:{line} imports {target}: {parts_name(target, parts)} is above {parts_name(module, parts)}")
            front = module.startswith(GRPC_FRONT), module.startswith(HTTP_FRONT)
            if (front[0] and target.startswith(HTTP_FRONT)) or (front[1] and target.startswith(GRPC_FRONT)):
                bad.append(f"{module}:{line} imports {target}: one front imports the other (consumer/server.py wires both)")
    return bad


def parts_name(module: str, parts: list[str]) -> str:
    pieces = module.split(".")
    return "the composition root" if len(pieces) > 1 and pieces[1] in ROOTS else f"{pieces[1]}/"


BENCH_ALLOWED = {  # a bench package -> what it may import of bench (bench/__init__.py)
    "bench.harness": ("bench.harness",),
    "bench.micro": ("bench.harness", "bench.micro"),
    "bench.serving": ("bench.harness", "bench.micro", "bench.demo", "bench.serving"),
    "bench.figures": ("bench.harness", "bench.serving", "bench.figures"),
    "bench.demo": ("bench.harness", "bench.demo"),
    "bench.peer": ("bench.harness", "bench.peer"),
    "bench.keep": ("bench.harness", "bench.keep"),
}


def bench_violations(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    allowed = BENCH_ALLOWED
    bad = []
    for module, imported in sorted(edges.items()):
        package = ".".join(module.split(".")[:2])
        if package not in allowed:
            continue
        for line, target in imported:
            if target.startswith("bench") and not target.startswith(allowed[package]) and target != "bench":
                bad.append(f"{module}:{line} imports {target}: {package} may import only {', '.join(allowed[package])}")
    return bad


def test_the_parts_are_listed_lowest_first():
    assert declared_parts() == ["engine", "link", "auto", "request", "exact", "pipeline", "api", "server"]
    for part in declared_parts()[:-1]:
        assert (ROOT / "consumer" / part / "__init__.py").exists(), part


def test_every_consumer_import_runs_down_the_parts():
    modules, edges = graph()
    assert sum(m.startswith("consumer.") for m in modules) > 30  # the walk found the parts
    bad = order_violations(edges, declared_parts())
    assert not bad, "\n".join(bad)


def test_bench_packages_import_one_way():
    """harness/ and micro/ import only below them; serving/ never imports figures/ (figures/ reads
    the rows serving/ writes); every bench module belongs to a package with its rule."""
    _, edges = graph()
    packages = {".".join(m.split(".")[:2]) for m in edges if m.startswith("bench.")}
    assert packages == set(BENCH_ALLOWED), packages
    bad = bench_violations(edges)
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_reversed_import_a_front_importing_the_other_and_a_stray_module():
    parts = ["engine", "link", "auto", "request", "exact", "pipeline", "api", "server"]
    edges = {
        "consumer.engine.batch": [(7, "consumer.pipeline.pipeline"), (8, "consumer.engine.kv_pool")],
        "consumer.api.servicer": [(3, "consumer.api.openai_api"), (4, "consumer.pipeline.pipeline")],
        "consumer.api.openai_api": [(5, "consumer.request.job")],
        "consumer.server": [(9, "consumer.api.openai_api"), (10, "consumer.api.servicer")],
        "consumer.stray": [],
        "bench.harness.services": [(2, "bench.serving.throughput")],
        "bench.micro.transport": [(6, "bench.harness.netns")],
        "bench.serving.adaptive": [(62, "bench.figures.serving"), (63, "bench.harness.netns")],
        "bench.figures.serving": [(16, "bench.serving.adaptive")],
    }
    assert order_violations(edges, parts) == [
        "consumer.api.servicer:3 imports consumer.api.openai_api: one front imports the other (consumer/server.py wires both)",
        "consumer.engine.batch:7 imports consumer.pipeline.pipeline: pipeline/ is above engine/",
        "consumer.stray belongs to no part listed in consumer/__init__.py",
    ]
    assert bench_violations(edges) == [
        "bench.harness.services:2 imports bench.serving.throughput: bench.harness may import only bench.harness",
        "bench.serving.adaptive:62 imports bench.figures.serving: bench.serving may import only bench.harness,"
        " bench.micro, bench.demo, bench.serving",
    ]
