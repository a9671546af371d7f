#!/usr/bin/env python3
"""Issue 45's restructure, replayable: consumer/ and bench/ as packages named after the design's parts.

    python3 scripts/relayout.py [--dry-run] [--no-ruff] [--allow-dirty]

on any checkout of main (a clean work tree), from the repository root. It
1. `git mv`s every file of MOVES (skipping moves already done, so a second run changes nothing),
   writes each new package's `__init__.py` docstring (PACKAGES) and splits the composition root
   (ConsumerServer) out of the gRPC front into consumer/server.py (SPLITS);
2. rewrites every reference to a moved module in every tracked text file from the old->new map:
   imports (`from consumer import a, b` regrouped by new package), dotted names in strings and
   prose (`python -m bench.x`, "consumer.x", logger names, docs, Makefile, compose, deploy/),
   file paths (`consumer/x.py`, `bench/ttft/`), and `Path(__file__)` climbs of the moved files;
   committed data (bench/results/, artifacts/, checkpoints/, protos/releases/) is left as written;
3. sorts the imports it touched (ruff, --select I) and formats the lint-covered packages;
4. checks the result: every project import and `-m` module resolves in the new tree, and every
   module under consumer/ or bench/ is placed. Anything it cannot place (a file another branch
   added, a move whose source is gone) is printed under WARNINGS and the exit status is 1.

It stages what it changed (`git add`); commit it as it is, then apply the hand-made changes.
It imports nothing of the project and nothing imports it.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path.cwd()
TOP = ("consumer", "bench")

# old path -> new path (a folder moves with everything in it). Names drop what the package says.
MOVES: list[tuple[str, str]] = [
    # consumer/engine/: the batch engine, one thread owns the device
    ("consumer/kv_pool.py", "consumer/engine/kv_pool.py"),
    ("consumer/kv_admission.py", "consumer/engine/kv_admission.py"),
    ("consumer/runner.py", "consumer/engine/runner.py"),
    ("consumer/batch.py", "consumer/engine/batch.py"),
    ("consumer/prefix_cache.py", "consumer/engine/prefix_cache.py"),
    ("consumer/decoding.py", "consumer/engine/decoding.py"),
    ("consumer/engine_process.py", "consumer/engine/process.py"),
    ("consumer/speculative.py", "consumer/engine/speculative.py"),
    # consumer/link/: the producer link, its stream contract and the names of a context's KV
    ("consumer/stream_reader.py", "consumer/link/stream_reader.py"),
    ("consumer/producer_client.py", "consumer/link/producer_client.py"),
    ("consumer/readiness.py", "consumer/link/readiness.py"),
    ("consumer/compat.py", "consumer/link/compat.py"),
    ("consumer/prefix_keys.py", "consumer/link/prefix_keys.py"),
    # consumer/auto/: mode auto
    ("consumer/auto.py", "consumer/auto/chooser.py"),
    ("consumer/planner.py", "consumer/auto/planner.py"),
    ("consumer/producer_memory.py", "consumer/auto/producer_memory.py"),
    ("consumer/probe.py", "consumer/auto/probe.py"),
    ("consumer/defaults.py", "consumer/auto/defaults.py"),
    # consumer/request/: one request's types and the steps every policy shares
    ("consumer/request.py", "consumer/request/job.py"),
    ("consumer/transfer.py", "consumer/request/transfer.py"),
    ("consumer/engine_stream.py", "consumer/request/engine_stream.py"),
    ("consumer/decode.py", "consumer/request/decode.py"),
    ("consumer/ending.py", "consumer/request/ending.py"),
    # consumer/exact/: the exact-answer policies
    ("consumer/audit_policy.py", "consumer/exact/audit_policy.py"),
    ("consumer/verify.py", "consumer/exact/verify.py"),
    ("consumer/repair.py", "consumer/exact/repair.py"),
    # consumer/pipeline/
    ("consumer/pipeline.py", "consumer/pipeline/pipeline.py"),
    ("consumer/learning.py", "consumer/pipeline/learning.py"),
    # consumer/api/: the fronts (ConsumerServer goes on to consumer/server.py: SPLITS)
    ("consumer/server.py", "consumer/api/servicer.py"),
    ("consumer/openai_api.py", "consumer/api/openai_api.py"),
    ("consumer/openai_schema.py", "consumer/api/openai_schema.py"),
    ("consumer/openai_chat.py", "consumer/api/openai_chat.py"),
    ("consumer/openai_reply.py", "consumer/api/openai_reply.py"),
    ("consumer/requests.py", "consumer/api/job_builder.py"),
    ("consumer/messages.py", "consumer/api/messages.py"),
    ("consumer/client.py", "consumer/api/client.py"),
    # bench/harness/: what every benchmark runs on
    ("bench/services.py", "bench/harness/services.py"),
    ("bench/shaping.py", "bench/harness/shaping.py"),
    ("bench/netns.py", "bench/harness/netns.py"),
    ("bench/relay.py", "bench/harness/relay.py"),
    ("bench/linkprobe.py", "bench/harness/linkprobe.py"),
    ("bench/workloads.py", "bench/harness/workloads.py"),
    ("bench/pairs.py", "bench/harness/pairs.py"),
    ("bench/provenance.py", "bench/harness/provenance.py"),
    ("bench/cpu_stages.py", "bench/harness/cpu_stages.py"),
    ("bench/flops.py", "bench/harness/flops.py"),
    # bench/micro/: one mechanism alone
    ("bench/transport.py", "bench/micro/transport.py"),
    ("bench/grpc_floor.py", "bench/micro/grpc_floor.py"),
    ("bench/engine_step.py", "bench/micro/engine_step.py"),
    ("bench/log_cost.py", "bench/micro/log_cost.py"),
    ("bench/rebuild_cost.py", "bench/micro/rebuild_cost.py"),
    # bench/serving/: the pair as real services
    ("bench/throughput.py", "bench/serving/throughput.py"),
    ("bench/load_test.py", "bench/serving/load_test.py"),
    ("bench/pool_test.py", "bench/serving/pool_test.py"),
    ("bench/prefix.py", "bench/serving/prefix.py"),
    ("bench/turns.py", "bench/serving/turns.py"),
    ("bench/adaptive.py", "bench/serving/adaptive.py"),
    ("bench/mixed.py", "bench/serving/mixed.py"),
    ("bench/quality.py", "bench/serving/quality.py"),
    ("bench/audit.py", "bench/serving/audit.py"),
    ("bench/verify.py", "bench/serving/verify.py"),
    ("bench/gpu_check.py", "bench/serving/gpu_check.py"),
    ("bench/compose_report.py", "bench/serving/compose_report.py"),
    ("bench/ttft", "bench/serving/ttft"),
    # bench/figures/: committed rows -> figures -> the generated documents
    ("bench/rows.py", "bench/figures/rows.py"),
    ("bench/figures.py", "bench/figures/figures.py"),
    ("bench/service_figures.py", "bench/figures/serving.py"),
    ("bench/verify_figures.py", "bench/figures/verify.py"),
    ("bench/gpu_figures.py", "bench/figures/gpu.py"),
    ("bench/plot.py", "bench/figures/plot.py"),
    ("bench/projection.py", "bench/figures/projection.py"),
    ("bench/report.py", "bench/figures/report.py"),
    ("bench/ab.py", "bench/figures/ab.py"),
]

# modules that stay where they are (with the package __init__ files below)
KEEP = {"consumer/__main__.py", "consumer/server.py", "bench/demo.py"}

# a name whose module differs from its old module's new place: ConsumerServer leaves the gRPC front
SYMBOLS = {"consumer.server.ConsumerServer": "consumer.server"}

# (file after the moves, class, new file, the new file's docstring): the class and what only it uses
SPLITS = [
    (
        "consumer/api/servicer.py",
        "ConsumerServer",
        "consumer/server.py",
        '"""The consumer process\'s composition root: `ConsumerServer` loads the model, builds the engine\n'
        "(consumer/engine/), the producer link (consumer/link/), the probes (consumer/auto/) and wires both\n"
        "fronts onto one servicer: the gRPC port (consumer/api/servicer.py) and the OpenAI HTTP port\n"
        "(consumer/api/openai_api.py); then health, readiness and drain. `python -m consumer` runs it.\n"
        '"""\n',
    ),
]

CONSUMER_DOC = '''"""The consumer service: rebuild the context's KV from the producer's stream, decode, stream tokens.

Its parts, one package each, lowest first: a module imports its own part or one listed above it
here, never one below (tests/test_consumer_parts.py reads every import against this list):

    engine/    the batch engine: KV pool, admission by KV memory, runner, scheduler, prefix cache,
               sampling and detokenization, the engine process; knows no request type, transfer or gRPC
    link/      the producer link: its gRPC client, the stream contract, readiness and compatibility,
               the names of a context's KV (prefix keys)
    auto/      mode auto: the planner's estimates, the chooser, what the producer holds, background
               probes, the default mode
    request/   one request: its job and result types, its transfer into its blocks, its engine task
               as an async stream, its decode loop and ending (the steps the policies and the
               pipeline share)
    exact/     the exact-answer policies over a rebuilt cache: audit, verified decoding, repair
    pipeline/  the request pipeline (admission, transfer, policies, decode) and what a finished
               request teaches auto
    api/       the fronts: the gRPC servicer, the OpenAI HTTP port and its schema, request
               validation (job_builder), the stream's messages; and the client of the service
    server.py  the composition root: builds the parts and wires both fronts (`python -m consumer`)
"""
'''

BENCH_DOC = '''"""Demo and benchmarks: real services in subprocesses, driven over gRPC, printing JSON lines.

    harness/   what every benchmark runs on: the services as processes, the shaped link (netns,
               tc, relay, link probes), workloads and model scales, the trained pairs, provenance,
               CPU per stage, FLOP counts; imports no other bench package
    micro/     one mechanism alone: gRPC transport, the gRPC call floor, the engine's step, a log
               line's CPU, the batched rebuild's CPU; imports harness/
    serving/   the pair under load: throughput, load and pool tests, prefix reuse and turns, mode
               auto per link, quality, the cache audit, verified decoding, TTFT (ttft/), the GPU check
    figures/   the committed rows (bench/results/) -> the figures -> docs/results.md and the
               README's generated blocks (`python -m bench.figures.report`)
    demo.py    `make demo`
"""
'''

PACKAGES = {
    "consumer/__init__.py": CONSUMER_DOC,
    "bench/__init__.py": BENCH_DOC,
    "consumer/engine/__init__.py": '"""The batch engine: one thread owns the compute device; each iteration runs the queued jobs,\n'
    "one prefill forward and one decode forward over every admitted request (batch.py), over one\n"
    "preallocated KV pool (kv_pool.py) that admission reserves from (kv_admission.py), with the\n"
    "model runner (runner.py), the prefix cache's chunks inside the pool (prefix_cache.py), sampling\n"
    "and detokenization (decoding.py), what a draft keeps for verified decoding's acceptance\n"
    "(speculative.py), and the engine in a process of its own (process.py).\n\n"
    "May import: shared. Knows no request type, transfer, policy or gRPC (consumer/__init__.py).\n"
    '"""\n',
    "consumer/link/__init__.py": '"""The producer link, the consumer\'s side of the wire: the gRPC client of the Prefill stream\n'
    "(producer_client.py), the stream contract it enforces (stream_reader.py), the link's\n"
    "readiness and compatibility checks (readiness.py, compat.py), and the names a context's KV\n"
    "goes by in the prefix cache and in the producer's store (prefix_keys.py).\n\n"
    "May import: consumer/engine/, shared.\n"
    '"""\n',
    "consumer/auto/__init__.py": '"""Mode `auto`: what each way of getting the context\'s KV costs here (planner.py, learned from\n'
    "finished requests), the choice among them within the request's loss budget (chooser.py), what\n"
    "this consumer's transfers left in the producer's store (producer_memory.py), background probes\n"
    "that keep the estimates fresh (probe.py) and the default mode (defaults.py).\n\n"
    "May import: consumer/link/, consumer/engine/, shared.\n"
    '"""\n',
    "consumer/request/__init__.py": '"""One request as the parts pass it along: what to do and what it reports (job.py), its\n'
    "transfer into its KV blocks (transfer.py), its engine task as an async stream\n"
    "(engine_stream.py), the decode loop every answer streams through (decode.py) and where an\n"
    "answer ends (ending.py): the steps the exact-answer policies and the pipeline both take.\n\n"
    "May import: consumer/auto/, consumer/link/, consumer/engine/, shared.\n"
    '"""\n',
    "consumer/exact/__init__.py": '"""The exact-answer policies over a rebuilt cache: the cache audit\'s report, fallback, upgrade\n'
    "and repair (audit_policy.py), anchor-token repair (repair.py) and verified decoding (verify.py).\n\n"
    "May import: consumer/request/, consumer/auto/, consumer/link/, consumer/engine/, shared.\n"
    '"""\n',
    "consumer/pipeline/__init__.py": '"""The request pipeline, the same for every codec: KV memory, prefix cache, transfer or own\n'
    "prefill, the exact-answer policies, decode (pipeline.py); and what a finished request teaches\n"
    "mode auto (learning.py).\n\n"
    "May import: consumer/exact/, consumer/request/, consumer/auto/, consumer/link/, consumer/engine/, shared.\n"
    '"""\n',
    "consumer/api/__init__.py": '"""The consumer\'s fronts. gRPC: the servicer (servicer.py), a GenerateRequest\'s validation into\n'
    "a job (job_builder.py), the stream's and Describe's messages (messages.py). HTTP: the\n"
    "OpenAI-compatible app (openai_api.py) with its requests in (openai_schema.py, openai_chat.py)\n"
    "and responses out (openai_reply.py). And the client of the service (client.py). The two fronts\n"
    "do not import each other: consumer/server.py wires them onto one servicer.\n\n"
    "May import: every consumer part below it (consumer/__init__.py), shared.\n"
    '"""\n',
    "bench/harness/__init__.py": '"""What every benchmark runs on: the services as real processes (services.py), the shaped link\n'
    "(shaping.py: the spec and tc; netns.py: namespaces and veth; relay.py: delay and rate in\n"
    "userspace; linkprobe.py: what the link does), workloads and model scales (workloads.py), the\n"
    "trained pairs (pairs.py), what a row ran on (provenance.py), CPU per stage (cpu_stages.py) and\n"
    "FLOP counts (flops.py).\n\n"
    "May import: shared, producer, consumer, qa; no other bench package.\n"
    '"""\n',
    "bench/micro/__init__.py": '"""One mechanism alone, each `python -m bench.micro.<name>`: the gRPC stream against a socket\n'
    "(transport.py), the floor of a gRPC call in Python (grpc_floor.py), the engine's step against\n"
    "the bare model's (engine_step.py), CPU per log line (log_cost.py) and per batched rebuild\n"
    "(rebuild_cost.py).\n\n"
    "May import: bench/harness/, shared, producer, consumer, qa.\n"
    '"""\n',
    "bench/serving/__init__.py": '"""The pair as real services, each `python -m bench.serving.<name>` (the make targets run them):\n'
    "throughput, load_test, pool_test, prefix, turns, adaptive (+ mixed), quality, audit, verify,\n"
    "ttft/ and gpu_check; compose_report judges a `make compose-smoke` run.\n\n"
    "May import: bench/harness/, bench/micro/, the figures' row formats (bench/figures/), shared,\n"
    "producer, consumer, qa.\n"
    '"""\n',
    "bench/figures/__init__.py": '"""The results documents from the committed rows: reading them (rows.py), every figure the\n'
    "documents quote (figures.py; serving.py, verify.py, gpu.py per benchmark; plot.py, projection.py),\n"
    "and docs/results.md, the README's generated blocks and bench/results/quality.md from\n"
    "bench/templates/ (report.py: `python -m bench.figures.report`, `--check` in the tests); ab.py\n"
    "compares two sets of throughput rows.\n\n"
    "May import: bench/harness/, the serving benchmarks' row formats (bench/serving/), shared, qa.\n"
    '"""\n',
}

# modules the docs name as history ("at e113533, since folded into bench.verify"): not checked
RETIRED = {"bench.repair"}

# committed data and generated code: never rewritten
SKIP_PREFIXES = (
    "bench/results/",
    "artifacts/",
    "checkpoints/",
    "protos/releases/",
    "shared/pb/",
    "tests/node/package-lock.json",
)
SKIP_FILES = {"scripts/relayout.py"}

WARNINGS: list[str] = []


def warn(message: str) -> None:
    WARNINGS.append(message)
    print(f"WARNING: {message}", file=sys.stderr)


def git(*args: str, check: bool = True) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if check and done.returncode != 0:
        sys.exit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def module_of(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def expanded_moves() -> list[tuple[str, str]]:
    """MOVES with each folder's files listed (from whichever side exists now)."""
    out = []
    for old, new in MOVES:
        if old.endswith(".py"):
            out.append((old, new))
            continue
        side, other = (old, new) if (ROOT / old).is_dir() else (new, old)
        for f in sorted(git("ls-files", side).split()):
            rel = f[len(side) :]
            out.append((old + rel, new + rel) if side == old else (other + rel, f))
    return out


# -- 1. moves ------------------------------------------------------------------------------------
def do_moves(dry: bool) -> list[tuple[str, str]]:
    """git mv every move not done yet; the moves done in this run."""
    done = []
    for old, new in MOVES:
        src, dst = ROOT / old, ROOT / new
        if src.exists() and dst.exists() and old in {target for _, _, target, _ in SPLITS}:
            continue  # moved before, and the split made the old path again (consumer/server.py)
        if src.exists() and dst.exists():
            warn(f"both {old} and {new} exist: move not made, merge them by hand")
        elif src.exists():
            files = [(old, new)] if old.endswith(".py") else [(f, new + f[len(old) :]) for f in git("ls-files", old).split()]
            if not dry:
                dst.parent.mkdir(parents=True, exist_ok=True)
                git("mv", old, new)
            done += files
        elif not dst.exists():
            warn(f"{old} is gone and {new} does not exist: its entry in MOVES is stale")
    return done


def write_packages(dry: bool) -> list[str]:
    written = []
    for path, doc in PACKAGES.items():
        p = ROOT / path
        if p.exists():
            current = p.read_text()
            body = ast.parse(current).body
            if not (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
                warn(f"{path} holds code, not only a docstring: left as it is")
                continue
            if current == doc:
                continue
        if not dry:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(doc)
        written.append(path)
    return written


# -- 2. the module map and the rewrite ------------------------------------------------------------
class Map:
    """The moves made in this run, old -> new, by module and by path. Only these are rewritten:
    text that names a module moved in an earlier run was rewritten then, so a second run leaves
    it alone (and `bench.figures.figures`, the function of the old module, is told apart from the
    new module of that name by when its module moved)."""

    def __init__(self, moves: list[tuple[str, str]]):
        self.modules = {module_of(o): module_of(n) for o, n in moves if o.endswith(".py")}
        self.paths = {o: n for o, n in moves}
        self.dirs = {}
        for old, new in MOVES:  # the packages that moved whole in this run
            if not old.endswith(".py") and any(o.startswith(old + "/") for o, _ in moves):
                self.modules[old.replace("/", ".")] = new.replace("/", ".")
                self.dirs[old] = new

    def resolve(self, dotted: str) -> str | None:
        """dotted's new spelling, None when it names nothing moved in this run."""
        parts = dotted.split(".")
        old_k = next(
            (k for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in self.modules),
            0,
        )
        if old_k == 0:
            return None
        old = ".".join(parts[:old_k])
        rest = parts[old_k:]
        if rest and f"{old}.{rest[0]}" in SYMBOLS:
            target = SYMBOLS[f"{old}.{rest[0]}"]
            return None if target == old else ".".join([target, *rest])
        return ".".join([self.modules[old], *rest])


DOTTED = re.compile(r"(?<![\w.])((?:consumer|bench)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
SLASHED = re.compile(r"(?<![\w.-])((?:consumer|bench)/[\w/]+\.py)\b")


def rewrite_text(text: str, m: Map) -> str:
    text = DOTTED.sub(lambda x: m.resolve(x.group(1)) or x.group(1), text)
    text = SLASHED.sub(lambda x: m.paths.get(x.group(1), x.group(1)), text)
    for old, new in m.dirs.items():
        text = re.sub(rf"(?<![\w.-]){re.escape(old)}(?![\w.])", new, text)
    return text


def rewrite_import_from(node: ast.ImportFrom, segment: str, m: Map, where: str) -> str:
    """`from M import a, b as c`: each name to its new module (one statement per module)."""
    if node.level or not node.module or node.module.split(".")[0] not in TOP:
        return segment
    module = node.module
    targets: list[tuple[str, str, str | None]] = []
    for alias in node.names:
        if alias.name == "*":
            targets.append((m.resolve(module) or module, "*", None))
            continue
        full = f"{module}.{alias.name}"  # a module of a package, or a name of a module
        new_full = m.resolve(full) or full
        new_module, _, name = new_full.rpartition(".")
        asname = alias.asname or (alias.name if name != alias.name else None)
        targets.append((new_module, name, asname))
    if all(t[0] == module for t in targets) and all(t[1] == a.name for t, a in zip(targets, node.names)):
        return segment
    if len({t[0] for t in targets}) == 1 and all(t[1] == a.name for t, a in zip(targets, node.names)):
        return re.sub(
            rf"^from\s+{re.escape(module)}\s+import",
            f"from {targets[0][0]} import",
            segment,
            count=1,
        )
    if "#" in segment:
        warn(f"{where}:{node.lineno}: a comment inside `from {module} import ...` was dropped when it was split")
    indent = " " * node.col_offset
    grouped: dict[str, list[str]] = {}
    for new_module, name, asname in targets:
        grouped.setdefault(new_module, []).append(name if asname is None or asname == name else f"{name} as {asname}")
    return ("\n" + indent).join(f"from {mod} import {', '.join(names)}" for mod, names in grouped.items())


def rewrite_python(text: str, m: Map, where: str) -> str:
    """Imports through the AST; strings, docstrings and comments as text; code only where a chain
    starts at the module itself (`import consumer.x` then `consumer.x.y`), never at a variable that
    happens to be called `consumer` or `bench`."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        warn(f"{where}: does not parse ({exc.msg}); rewritten as plain text")
        return rewrite_text(text, m)
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))

    def offset(lineno: int, col: int, in_bytes: bool = True) -> int:
        line = lines[lineno - 1] if lineno <= len(lines) else ""
        return starts[lineno - 1] + (len(line.encode()[:col].decode(errors="ignore")) if in_bytes else col)

    edits: list[tuple[int, int, str]] = []
    taken: list[tuple[int, int]] = []
    bound = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.asname is None}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            start, end = (
                offset(n.lineno, n.col_offset),
                offset(n.end_lineno or n.lineno, n.end_col_offset or 0),
            )
            segment = text[start:end]
            if isinstance(n, ast.ImportFrom):
                new = rewrite_import_from(n, segment, m, where)
            else:
                new = segment
                for a in n.names:
                    target = m.resolve(a.name) if a.name.split(".")[0] in TOP else None
                    if target:
                        new = re.sub(
                            rf"(?<![\w.]){re.escape(a.name)}(?![\w.])",
                            target,
                            new,
                            count=1,
                        )
            taken.append((start, end))
            if new != segment:
                edits.append((start, end, new))
        elif isinstance(n, ast.Attribute) and n.lineno == n.end_lineno:
            chain, root = [n.attr], n.value
            while isinstance(root, ast.Attribute):
                chain.append(root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in TOP and root.id in bound:
                dotted = ".".join([root.id, *reversed(chain)])
                target = m.resolve(dotted)
                if target:
                    start = offset(root.lineno, root.col_offset)
                    edits.append((start, start + len(dotted), target))
                    taken.append((start, start + len(dotted)))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            start, end = (
                offset(*tok.start, in_bytes=False),
                offset(*tok.end, in_bytes=False),
            )
            if any(a <= start < b for a, b in taken):
                continue
            if tok.type == tokenize.STRING and "f" in tok.string[: tok.string.find(tok.string[-1])].lower():
                # an f-string's {fields} are code: a variable called consumer stays as it is
                new = "".join(p if p.startswith("{") else rewrite_text(p, m) for p in re.split(r"(\{[^{}]*\})", tok.string))
            else:
                new = rewrite_text(tok.string, m)
            if new != tok.string:
                edits.append((start, end, new))
    # an attribute chain is found once per prefix (a.b.c, a.b): keep the longest at each start
    chosen: dict[int, tuple[int, int, str]] = {}
    for e in edits:
        if e[0] not in chosen or e[1] > chosen[e[0]][1]:
            chosen[e[0]] = e
    out, at = [], 0
    for start, end, new in sorted(chosen.values()):
        if start < at:
            warn(f"{where}: overlapping rewrites at offset {start}: check this file by hand")
            continue
        out += [text[at:start], new]
        at = end
    out.append(text[at:])
    return "".join(out)


FILE_CLIMB = re.compile(r"Path\(__file__\)(\.resolve\(\))?((?:\.parent)+(?![\w\[])|\.parents\[(\d+)\])")


def fix_file_climbs(text: str, delta: int, where: str) -> str:
    """`Path(__file__).parent...` of a file that moved `delta` folders deeper still names the same folder."""

    def climb(x: re.Match) -> str:
        ups = int(x.group(3)) + 1 if x.group(3) is not None else x.group(2).count(".parent")
        ups += delta
        tail = ".parent" if ups == 1 else f".parents[{ups - 1}]"
        return f"Path(__file__){x.group(1) or ''}{tail}"

    fixed, n = FILE_CLIMB.subn(climb, text)
    if text.count("__file__") != n:
        warn(f"{where}: a use of __file__ that is not Path(__file__).parent(s): check it names the same folder")
    return fixed


# -- the split of a class into a module of its own -------------------------------------------------
def split_class(source_path: str, cls: str, target_path: str, doc: str, dry: bool) -> bool:
    src, dst = ROOT / source_path, ROOT / target_path
    if not src.exists():
        warn(f"split: {source_path} does not exist")
        return False
    text = src.read_text()
    tree = ast.parse(text)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    if node is None:
        if dst.exists() and f"class {cls}" in dst.read_text():
            return False  # done before
        warn(f"split: no class {cls} in {source_path}")
        return False
    if dst.exists():
        warn(f"split: {target_path} exists and {source_path} still has {cls}: merge by hand")
        return False
    lines = text.splitlines(keepends=True)
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    last = node.end_lineno or node.lineno
    body = "".join(lines[first:last])
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    head = "".join("".join(lines[n.lineno - 1 : n.end_lineno]) for n in imports)
    defined: dict[str, ast.stmt] = {}  # module-level names of the source other than imports and the class
    for n in tree.body:
        if n is node or n in imports:
            continue
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[n.name] = n
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if isinstance(t, ast.Name):
                    defined[t.id] = n
    used = {x.id for x in ast.walk(node) if isinstance(x, ast.Name)} | {
        a.value.id for a in ast.walk(node) if isinstance(a, ast.Attribute) and isinstance(a.value, ast.Name)
    }
    copied = [n for name, n in defined.items() if name in used and name == "log"]  # a module's own logger
    imported = sorted(name for name in used if name in defined and name != "log")
    src_module = module_of(source_path)
    extra = f"from {src_module} import {', '.join(imported)}\n" if imported else ""
    own = "".join("".join(lines[n.lineno - 1 : n.end_lineno]) for n in copied)
    new_text = f"{doc}\n{head}{extra}\n{own}\n\n{body}"
    rest = "".join(lines[:first]).rstrip("\n") + "\n" + ("\n\n" + "".join(lines[last:]).lstrip("\n") if lines[last:] else "")
    if not dry:
        dst.write_text(new_text)
        src.write_text(rest)
    return True


# -- checks ---------------------------------------------------------------------------------------
def tree_modules() -> dict[str, Path]:
    found = {}
    for top in TOP:
        for p in sorted((ROOT / top).rglob("*.py")):
            found[module_of(str(p.relative_to(ROOT)))] = p
    return found


def top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                names |= {x.id for x in ast.walk(t) if isinstance(x, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
        elif isinstance(n, (ast.If, ast.Try)):
            names |= {x.id for x in ast.walk(n) if isinstance(x, ast.Name) and isinstance(x.ctx, ast.Store)}
            names |= {
                (a.asname or a.name).split(".")[0]
                for x in ast.walk(n)
                if isinstance(x, (ast.Import, ast.ImportFrom))
                for a in x.names
            }
    return names


def check_tree(files: list[str]) -> None:
    modules = tree_modules()
    placed = {n for _, n in expanded_moves()} | KEEP | set(PACKAGES)
    for name, path in modules.items():
        rel = str(path.relative_to(ROOT))
        if rel not in placed and not rel.endswith("__init__.py"):
            warn(f"NOT IN MAP: {rel} ({name}) is not placed by MOVES: add it (old -> new) and run again")
    names_cache: dict[str, set[str]] = {}
    run_m = re.compile(r"""(?:-m\s+|["']-m["'],\s*["'])((?:consumer|bench)(?:\.\w+)*)""")
    for rel in files:
        if (
            not rel.endswith(".py")
            and rel not in ("Makefile", "README.md")
            and not rel.startswith(("docs/", "docker", "deploy/"))
        ):
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for x in run_m.finditer(text):
            mod = x.group(1)
            if mod not in modules and f"{mod}.__main__" not in modules and mod not in RETIRED:
                warn(f"{rel}: `-m {mod}` names no module")
        if not rel.endswith(".py"):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] in TOP and a.name not in modules:
                        warn(f"{rel}:{n.lineno}: import {a.name}: no such module")
            elif isinstance(n, ast.ImportFrom) and not n.level and n.module and n.module.split(".")[0] in TOP:
                if n.module not in modules:
                    warn(f"{rel}:{n.lineno}: from {n.module}: no such module")
                    continue
                for a in n.names:
                    if f"{n.module}.{a.name}" in modules or a.name == "*":
                        continue
                    names = names_cache.setdefault(n.module, top_level_names(modules[n.module]))
                    if a.name not in names:
                        warn(f"{rel}:{n.lineno}: from {n.module} import {a.name}: {n.module} defines no {a.name}")


def text_files() -> list[str]:
    out = []
    for rel in git("ls-files").split("\n"):
        if not rel or rel in SKIP_FILES or rel.startswith(SKIP_PREFIXES):
            continue
        p = ROOT / rel
        if not p.is_file() or p.is_symlink() or p.stat().st_size > 2_000_000:
            continue
        data = p.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode()
        except UnicodeDecodeError:
            continue
        out.append(rel)
    return out


def ruff(args: list[str], files: list[str]) -> None:
    exe = ROOT / ".venv/bin/ruff"
    cmd = [str(exe) if exe.exists() else "ruff", *args, *files]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode not in (0, 1):
        warn(f"{' '.join(cmd[:4])} ...: exit {done.returncode}: {done.stderr.strip()[:300]}")


def rewrapped(rel: str, before: str, after: str) -> None:
    """ruff format may only have regrouped imports: a longer module name that pushed a line past
    the limit gets that line rewrapped, and some lines are read as text (shared/config.py's field
    comments are the flags' --help): each such place is a WARNING to shorten by hand."""
    if before == after:
        return
    imports = set()
    for n in ast.walk(ast.parse(after)):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            imports |= set(range(n.lineno, (n.end_lineno or n.lineno) + 1))
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        lines = set(range(j1 + 1, j2 + 1))
        if tag != "equal" and lines - imports:
            warn(
                f"{rel}:{j1 + 1}-{j2}: ruff format rewrapped code (a longer module name made a line too long): shorten it by hand"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="say what would move; change nothing")
    parser.add_argument(
        "--no-ruff",
        action="store_true",
        help="do not sort imports or format afterwards",
    )
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run on a work tree with uncommitted changes",
    )
    args = parser.parse_args()
    if not (ROOT / "consumer").is_dir() or not (ROOT / "bench").is_dir():
        sys.exit("run from the repository root")
    if not args.allow_dirty and git("status", "--porcelain", "--untracked-files=no").strip():
        sys.exit("the work tree has uncommitted changes: commit or stash them (or --allow-dirty)")

    moved = do_moves(args.dry_run)
    print(f"moved {len(moved)} files")
    if args.dry_run:
        for old, new in moved:
            print(f"  {old} -> {new}")
        return 1 if WARNINGS else 0
    created = write_packages(False)
    m = Map(moved)
    changed: list[str] = []
    if moved:
        for rel in text_files():
            if rel in created:
                continue
            p = ROOT / rel
            text = p.read_text()
            new = rewrite_python(text, m, rel) if rel.endswith(".py") else rewrite_text(text, m)
            if new != text:
                p.write_text(new)
                changed.append(rel)
        for old, new in moved:
            delta = len(Path(new).parts) - len(Path(old).parts)
            p = ROOT / new
            if delta and new.endswith(".py") and "__file__" in p.read_text():
                p.write_text(fix_file_climbs(p.read_text(), delta, new))
                changed.append(new)
    split_files = []
    for source, cls, target, doc in SPLITS:
        if split_class(source, cls, target, doc, False):
            split_files += [source, target]
    if not args.no_ruff:
        if split_files:  # what each side of a split no longer uses
            ruff(["check", "--fix", "--select", "F401", "--quiet"], split_files)
        py = sorted({f for f in changed + split_files + created if f.endswith(".py") and (ROOT / f).exists()})
        if py:
            ruff(["check", "--fix", "--select", "I", "--quiet"], py)
            linted = [f for f in py if f.split("/")[0] in ("shared", "producer", "consumer", "calibration")]
            if linted:
                before = {f: (ROOT / f).read_text() for f in linted}
                ruff(["format", "--quiet"], linted)
                for f in linted:
                    rewrapped(f, before[f], (ROOT / f).read_text())
    touched = sorted(set(changed + split_files + created))
    if touched:
        git("add", "--", *touched)
    print(f"rewrote {len(set(changed))} files, wrote {len(created)} package docstrings, split {len(split_files) // 2} classes")
    check_tree(text_files())
    if WARNINGS:
        print(
            f"\nWARNINGS ({len(WARNINGS)}): fix MOVES or the tree, then run again",
            file=sys.stderr,
        )
        for w in WARNINGS:
            print(f"  - {w}", file=sys.stderr)
        return 1
    print("done: every module placed, every import and -m module resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
