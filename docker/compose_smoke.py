"""`make compose-smoke`: the compose stack for real, on a machine with no registry.

Installs what is missing (Debian's docker.io and debootstrap; starts dockerd when no engine
answers, and stops it again at the end), builds a local Debian bookworm base image
(docker/base-image.sh) and the host wheelhouse (docker/wheelhouse.sh), builds the producer and
consumer images with docker-compose, brings the stack up (2 producer replicas), waits until every
container's health check says healthy, runs `python -m bench.demo --consumer` against the
consumer's published port on 127.0.0.1 (one question per transfer mode), asks each producer
replica how many prefills it served, stops the stack (SIGTERM, drain) and removes it.

Prints one JSON line: images_built, healthy_after_s (from `up` to every container healthy),
demo_modes_ok (oracle, raw, quant, recompute and scd each answered with tokens), producers
(healthy producer replicas); also modes, scd_match_oracle, prefills_by_producer, stop_s and
stop_exit_codes (0 = drained and exited cleanly). Exit status 0 only when all of it held.
Environment: SCD_BASE_IMAGE (skip the local base build, e.g. python:3.11-slim), SCD_PRODUCERS,
COMPOSE (docker-compose binary), SCD_SMOKE_HEALTH_TIMEOUT_S (default 300).
Not part of `make test` (minutes, needs root and a Docker engine).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "scd-smoke"
MODES = {"oracle", "raw", "quant", "recompute", "scd"}
LOCAL_BASE = "scd-base:bookworm"
DESCRIBE = (
    "import grpc; from shared.pb import producer_pb2 as p, producer_pb2_grpc as g; "
    "c = grpc.insecure_channel('127.0.0.1:50051'); "
    "print(g.ProducerServiceStub(c).Describe(p.ProducerServiceDescribeRequest(), timeout=10).stats.prefills_started)"
)


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def sh(*cmd: str, env: dict | None = None, capture: bool = False, check: bool = True, timeout: float | None = None) -> str:
    result = subprocess.run(
        cmd, cwd=ROOT, env=env, text=True, timeout=timeout, stdout=subprocess.PIPE if capture else sys.stderr, stderr=sys.stderr
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {result.returncode}")
    return result.stdout or ""


def ensure_engine() -> subprocess.Popen | None:
    """Install docker.io/debootstrap when missing; start dockerd when no engine answers.
    Returns the dockerd process this call started (None when one was running)."""
    missing = [pkg for pkg, tool in (("docker.io", "dockerd"), ("debootstrap", "debootstrap")) if not shutil.which(tool)]
    if missing:
        log(f"installing {' '.join(missing)}")
        sh("apt-get", "update", "-q")
        sh("apt-get", "install", "-y", "-q", *missing, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return None
    log("starting dockerd (log: /tmp/scd-smoke-dockerd.log)")
    proc = subprocess.Popen(["dockerd"], stdout=open("/tmp/scd-smoke-dockerd.log", "w"), stderr=subprocess.STDOUT)
    for _ in range(60):
        if subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
            return proc
        time.sleep(1)
    raise RuntimeError("dockerd did not answer within 60 s")


def containers(compose: list[str], service: str) -> list[str]:
    return sh(*compose, "ps", "-q", service, capture=True).split()


def health(cid: str) -> str:
    return sh("docker", "inspect", "-f", "{{.State.Health.Status}}", cid, capture=True).strip()


def wait_healthy(compose: list[str], expected: dict[str, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = {s: containers(compose, s) for s in expected}
        states = [health(c) for cids in ids.values() for c in cids]
        if all(len(ids[s]) == n for s, n in expected.items()) and all(s == "healthy" for s in states):
            return
        if "unhealthy" in states:
            break
        time.sleep(1)
    raise RuntimeError(f"stack not healthy: {states}")


def run_demo(address: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.demo", "--consumer", address], cwd=ROOT, text=True, capture_output=True, timeout=600
    )
    sys.stderr.write(out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"demo: exit {out.returncode}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    compose_bin = os.environ.get("COMPOSE", str(ROOT / ".venv-compose/bin/docker-compose"))
    producers = int(os.environ.get("SCD_PRODUCERS", "2"))
    dockerd = ensure_engine()
    base = os.environ.get("SCD_BASE_IMAGE") or LOCAL_BASE
    if base == LOCAL_BASE:
        sh(str(ROOT / "docker/base-image.sh"), LOCAL_BASE)
    sh(str(ROOT / "docker/wheelhouse.sh"), str(Path(sys.executable).parent / "pip"))
    # read by docker-compose.yml; "127.0.0.1:" publishes the consumer on a free loopback port
    os.environ.update(
        {"SCD_BASE_IMAGE": base, "SCD_PRODUCERS": str(producers), "SCD_CONSUMER_PUBLISH": "127.0.0.1:", "SCD_IMAGE_TAG": "smoke"}
    )
    compose = [compose_bin, "-p", PROJECT, "-f", str(ROOT / "docker-compose.yml")]
    report: dict = {"images_built": 0, "healthy_after_s": None, "demo_modes_ok": False, "producers": 0}
    ok = False
    try:
        started = time.monotonic()
        sh(*compose, "build", "producer", "consumer")
        report["images_built"] = sum(
            subprocess.run(["docker", "image", "inspect", f"scd-{s}:smoke"], capture_output=True).returncode == 0
            for s in ("producer", "consumer")
        )
        log(f"images built in {time.monotonic() - started:.0f} s")
        started = time.monotonic()
        sh(*compose, "up", "-d", "--no-build")
        wait_healthy(compose, {"producer": producers, "consumer": 1}, float(os.environ.get("SCD_SMOKE_HEALTH_TIMEOUT_S", "300")))
        report["healthy_after_s"] = round(time.monotonic() - started, 1)
        pids = containers(compose, "producer")
        report["producers"] = sum(health(c) == "healthy" for c in pids)
        address = sh(*compose, "port", "consumer", "50052", capture=True).strip().replace("0.0.0.0", "127.0.0.1")
        log(f"stack healthy after {report['healthy_after_s']} s; demo against {address}")
        rows = run_demo(address)
        report["modes"] = sorted(r["mode"] for r in rows)
        report["demo_modes_ok"] = set(report["modes"]) == MODES and all(r["tokens"] > 0 for r in rows)
        report["scd_match_oracle"] = next((r["match_oracle"] for r in rows if r["mode"] == "scd"), None)
        report["prefills_by_producer"] = [int(sh("docker", "exec", c, "python", "-c", DESCRIBE, capture=True)) for c in pids]
        stop_started = time.monotonic()
        sh(*compose, "stop")
        report["stop_s"] = round(time.monotonic() - stop_started, 1)
        ids = containers(compose, "producer") + containers(compose, "consumer")
        report["stop_exit_codes"] = sorted(
            int(sh("docker", "inspect", "-f", "{{.State.ExitCode}}", c, capture=True)) for c in ids
        )
        ok = (
            report["images_built"] == 2
            and report["demo_modes_ok"]
            and report["producers"] == producers
            and set(report["stop_exit_codes"]) == {0}
        )
    except Exception as exc:  # report, show the logs, still tear down
        report["error"] = str(exc)
        sh(*compose, "logs", "--tail", "40", check=False)
    finally:
        sh(*compose, "down", "-v", "--remove-orphans", check=False)
        if dockerd is not None:
            dockerd.terminate()
            dockerd.wait(timeout=30)
    print(json.dumps(report), flush=True)
    if ok:  # the figure docs/results.md quotes (make results-doc)
        (ROOT / "bench/results/compose.json").write_text(json.dumps(report) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
