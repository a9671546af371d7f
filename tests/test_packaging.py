"""The wire contract lints clean, generated code is current, and the compose file validates."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_buf_lint_is_clean():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    result = subprocess.run([buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_field_and_rpc_is_commented():
    for proto in (ROOT / "protos/scd/v1").glob("*.proto"):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = re.match(r"^(repeated |map<[^>]+> )?[\w.]+ \w+ = \d+;", stripped)
            if (is_field or stripped.startswith("rpc ")) and "//" not in line and not lines[i - 1].strip().startswith("//"):
                pytest.fail(f"{proto.name}:{i + 1} has no comment: {stripped}")


def test_generated_code_is_newer_than_protos():
    stamp = ROOT / "shared/pb/scd/v1/.generated"
    assert stamp.exists(), "run `make proto`"
    newest = max(p.stat().st_mtime for p in (ROOT / "protos/scd/v1").glob("*.proto"))
    assert stamp.stat().st_mtime >= newest, "protos changed since generation: run `make proto`"


def test_compose_file_validates():
    compose = ROOT / ".venv-compose/bin/docker-compose"
    if not compose.exists():
        pytest.skip("docker-compose 1.29.2 not installed: `make test` installs it into .venv-compose")
    result = subprocess.run([str(compose), "-f", "docker-compose.yml", "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = (ROOT / "docker-compose.yml").read_text()
    graces = [int(g) for g in re.findall(r"stop_grace_period: (\d+)s", text)]
    drains = [int(d) for d in re.findall(r'DRAIN_GRACE_S: "(\d+)"', text)]
    assert graces and drains and min(graces) > max(drains)
