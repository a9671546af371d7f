"""`python -m producer` / `python -m consumer`: the process around a service. Config from flags and
env, logs, the process settings (malloc, oneDNN's kernel cache, torch threads: shared.torch_threads),
start-up checks and the model loaded with its artifacts (shared.startup), so that a wrong one fails
before the server binds; then start -> load -> serve under uvloop until SIGTERM/SIGINT -> drain.
Any start-up failure: one JSON log line, one sentence on stderr, exit 2."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
from collections.abc import Awaitable, Callable

from shared import logs, startup, torch_threads
from shared.config import ServerConfig
from shared.torch_threads import intra_op_threads


def run(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run main(stop_event) under uvloop; SIGTERM/SIGINT set stop_event."""
    import uvloop

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    uvloop.run(runner())


def main(service: str, config_cls: type[ServerConfig], server_cls: type, argv: list[str] | None) -> None:
    """`python -m <service>`: config from flags/env, logs, the process settings, start-up checks
    (shared.startup), the model loaded and the artifacts chosen for its weights (so a wrong
    artifact fails before the server binds or logs anything), then start -> load(loaded) -> serve
    until SIGTERM/SIGINT -> drain. `server_cls(config)` has async start(), load(loaded) and stop().
    Any start-up failure: one JSON log line, one sentence on stderr, exit 2."""
    from shared import core_log

    core_log.install(service)  # gRPC core's own stderr lines become JSON lines (failed TLS handshakes counted)
    cfg = _config(service, config_cls, argv)
    _tune_process(service, cfg)
    loaded, cfg = _checked_model(service, cfg)
    torch_threads.pin(1)  # the event loop's thread forms no OpenMP team (shared.torch_threads)
    failed: list[str] = []
    run(functools.partial(_serve, service, cfg, server_cls, loaded, failed))
    if failed:
        startup.fail(service, failed[0])


def _config(service: str, config_cls: type[ServerConfig], argv: list[str] | None) -> ServerConfig:
    """The config from flags and env, and the logs at its level (a bad value: a start-up failure)."""
    from shared import config as config_lib

    try:
        cfg = config_lib.load(config_cls, service, argv)
    except ValueError as exc:
        logs.configure(service, "INFO")
        startup.fail(service, f"configuration: {exc}")
    logs.configure(service, cfg.log_level)
    return cfg


def _tune_process(service: str, cfg: ServerConfig) -> None:
    """Before the model loads: malloc's mmap threshold, oneDNN's kernel cache, torch's threads; no
    progress bars on stderr (it carries JSON log lines only)."""
    from shared import malloc_tuning

    logs.get(service).info("startup.malloc", setting=malloc_tuning.tune(cfg.malloc_mmap_threshold))
    from shared import kernel_cache  # before the model loads: oneDNN reads its cache sizes at its first kernel

    logs.get(service).info("startup.kernel_cache", setting=kernel_cache.bound(cfg.onednn_cache_entries))
    threads, why = intra_op_threads(cfg.torch_threads, cfg.device, os.environ)
    if threads:
        import torch

        torch.set_num_threads(threads)  # before any forward: the pool torch sizes its parallel regions for
    logs.get(service).info("startup.threads", torch_threads=threads or "torch's default", reason=why)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries JSON log lines only


def _checked_model(service: str, cfg: ServerConfig):
    """The start-up checks, then the model loaded with its artifacts (shared.startup.load_checked);
    a failure is one sentence, not a traceback: the message says what to fix."""
    try:
        startup.check(cfg)
    except startup.StartupError as exc:
        startup.fail(service, str(exc))
    try:
        # on a thread that ends: its OpenMP team ends with it (shared.torch_threads)
        return torch_threads.on_new_thread(startup.load_checked, service, cfg, name=f"{service}-load")
    except startup.StartupError as exc:
        startup.fail(service, str(exc))
    except Exception as exc:
        startup.fail(service, f"{type(exc).__name__}: {exc}")


async def _serve(service: str, cfg: ServerConfig, server_cls: type, loaded, failed: list[str], stop: asyncio.Event) -> None:
    """Start, load, serve until `stop`, drain; a failure to start or load goes into `failed`."""
    from shared import heap_trace  # a diagnostic: SCD_HEAP_TRACE=<dir> turns it on, SIGUSR2 dumps

    if heap_trace.install(service, asyncio.get_running_loop()):
        logs.get(service).warning("startup.heap_trace", directory=os.environ[heap_trace.ENV], note="diagnostic: slow")
    # asyncio.to_thread's pool (store reads, plans, kernel builds) forms no OpenMP team (shared.torch_threads)
    asyncio.get_running_loop().set_default_executor(torch_threads.pinned_pool(None, f"{service}-io"))
    server = None
    try:
        server = server_cls(cfg)  # binds ports, opens the disk tier and KV event sockets
        await server.start()
        await server.load(loaded)
        startup.loaded_artifacts(service, server.servicer)
    except Exception as exc:  # one line, not a traceback: the message says what to fix
        failed.append(str(exc) if isinstance(exc, startup.StartupError) else f"{type(exc).__name__}: {exc}")
        if server is not None:
            with contextlib.suppress(Exception):
                await server.stop(0)
        return
    await stop.wait()
    await server.stop()
