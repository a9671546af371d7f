"""Start the producer and consumer as real processes (optionally inside network namespaces),
wait for gRPC health SERVING, and stop them with SIGTERM (graceful drain) on exit."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.healthcheck import check

ROOT = Path(__file__).resolve().parents[2]


# consumer flags of a benchmark that times transfers of repeated contexts: the consumer's prefix
# cache would answer a repeat with no transfer at all (bench.serving.prefix measures that cache)
NO_PREFIX_CACHE = ("--prefix-cache-bytes", "0")


def code_version(root: Path = ROOT) -> str:
    """The commit the services run from (with "+dirty" when the working tree has changes): what a
    benchmark row measured. `root`: another checkout's (a worktree a bench measures)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def checkout_prefix(root: Path) -> tuple[str, ...]:
    """The command prefix that runs a service from another checkout (a worktree of an earlier
    commit, its protos generated): `python -m NAME` there imports that checkout's code."""
    return ("bash", "-c", f'cd {shlex.quote(str(root))} && exec "$0" "$@"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    address: str
    process: subprocess.Popen
    log_path: Path


def wait_healthy(service: Service, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check(service.address, timeout_s=1.0):
        if service.process.poll() is not None:
            raise RuntimeError(f"{service.name} exited with {service.process.returncode}; log: {service.log_path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service.name} not SERVING after {timeout_s}s; log: {service.log_path}")
        time.sleep(0.2)


def spawn(name: str, args: Sequence[str], address: str, log_dir: Path, prefix: Sequence[str] = ()) -> Service:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen([*prefix, sys.executable, "-m", name, *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
    return Service(name, address, process, log_path)


def children(pid: int) -> list[int]:
    """The running child processes of pid (the consumer's engine process under --engine-process)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def stop(service: Service, timeout_s: float = 30.0) -> int:
    """SIGTERM, wait for the drain, return the exit code (SIGKILL after timeout_s)."""
    if service.process.poll() is None:
        service.process.send_signal(signal.SIGTERM)
        try:
            service.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()
    return service.process.returncode


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def running(producer_args: Sequence[str], consumer_args: Sequence[str], log_dir: Path,
            producer_host: str = "127.0.0.1", consumer_host: str = "127.0.0.1",
            producer_prefix: Sequence[str] = (), consumer_prefix: Sequence[str] = (),
            timeout_s: float = 300.0,
            producer_target: Callable[[str], str] = lambda address: address) -> Iterator[tuple[Service, Service]]:
    """Producer then consumer (pointed at it, or at what `producer_target` makes of its address: a
    relay on the path), both SERVING; both stopped on exit, also when this
    process gets SIGTERM (turned into SystemExit so the cleanup runs; no orphaned services). Python
    runs the handler in the main thread at its next bytecode: a main thread blocked in one long C
    call (a long sleep) notices a SIGTERM the kernel delivered to another thread only afterwards."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    pport, cport = free_port(), free_port()
    producer = spawn("producer", ["--host", producer_host, "--port", str(pport), *producer_args],
                     f"{producer_host}:{pport}", log_dir, producer_prefix)
    consumer = None
    try:
        wait_healthy(producer, timeout_s)  # first: the consumer checks its producer when it starts
        consumer = spawn("consumer", ["--host", consumer_host, "--port", str(cport), "--producer",
                                      producer_target(f"{producer_host}:{pport}"), *consumer_args],
                         f"{consumer_host}:{cport}", log_dir, consumer_prefix)
        wait_healthy(consumer, timeout_s)
        yield producer, consumer
    finally:
        codes = {}
        if consumer is not None:
            codes["consumer"] = stop(consumer)
        codes["producer"] = stop(producer)
        print(f"# services stopped: exit codes {codes}", file=sys.stderr)
