"""The import layering, read from the source (ast), so it cannot drift:

    bench  ->  real  ->  qa  ->  {producer, consumer, calibration}  ->  shared

A module may import its own package or a package of a lower layer, never one beside or above
it, and no set of modules imports itself in a cycle. Every import counts, also those inside
functions and under TYPE_CHECKING. shared/pb (generated code) is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"shared": 0, "producer": 1, "consumer": 1, "calibration": 1, "qa": 2, "real": 3, "bench": 4}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for package in LAYER:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "pb" in path.relative_to(ROOT).parts[1:2]:
                continue
            found[module_name(path)] = path
    return found


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported project module) for every import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from a.b import c` is module a.b.c when that is a module, else a.b
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.append((node.lineno, name))
    return out


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[int, str]]]]:
    modules = project_modules()
    return modules, {m: imports_of(p, modules) for m, p in modules.items()}


def layering_violations(modules, edges, root: Path = ROOT) -> list[str]:
    bad = []
    for module, imported in edges.items():
        own = module.split(".")[0]
        for line, target in imported:
            other = target.split(".")[0]
            if other != own and LAYER[other] >= LAYER[own]:
                where = "above" if LAYER[other] > LAYER[own] else "beside"
                bad.append(f"{modules[module].relative_to(root)}:{line} imports {target} ({other} is {where} {own})")
    return bad


def cycles(edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a self-import."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or any(t == v for _, t in edges.get(v, [])):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_import_goes_down_the_layers():
    modules, edges = graph()
    assert len(modules) > 40  # the walk found the project
    assert layering_violations(modules, edges) == []


def test_no_import_cycles():
    _, edges = graph()
    assert cycles(edges) == []


def test_the_checks_catch_an_upward_import_and_a_cycle(tmp_path):
    modules = {"shared.a": tmp_path / "a.py", "shared.b": tmp_path / "b.py", "qa.c": tmp_path / "c.py",
               "producer.d": tmp_path / "d.py"}
    edges = {"shared.a": [(3, "qa.c"), (4, "shared.b")], "shared.b": [(1, "shared.a")], "qa.c": [(2, "producer.d")],
             "producer.d": [(5, "consumer.e")]}
    modules["consumer.e"] = tmp_path / "e.py"
    assert layering_violations(modules, edges, tmp_path) == ["a.py:3 imports qa.c (qa is above shared)",
                                                             "d.py:5 imports consumer.e (consumer is beside producer)"]
    assert cycles(edges) == [["shared.a", "shared.b"]]


@pytest.mark.parametrize("module", ["shared.service_main, shared.grpc_server, shared.rpc_errors", "shared.scd.ops", "shared.scd.artifact", "shared.codecs.scd"])
def test_the_serving_runtime_loads_without_offline_packages(module):
    """What the services import never pulls in calibration, the test-bed or a service."""
    import subprocess
    import sys

    code = (f"import sys, {module}; bad = [m for m in ('calibration', 'qa', 'real', 'bench', 'producer', 'consumer') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
