"""gRPC core's own log lines as JSON log lines, and a count of failed TLS handshakes.

gRPC's C core writes its log (`I1201 13:26:17.78 14341 ssl_transport_security.cc:2563] Handshake
failed ...`) straight to file descriptor 2, beside the services' JSON lines. `install` puts a
pipe on fd 2 and one reader thread behind it: a core line becomes a JSON line (a failed TLS
handshake: `tls.handshake_failed`, counted in `handshake_failures`; errors: `grpc.core`; info
lines are dropped), anything else passes through unchanged and in order. Python's own `sys.stderr`
(the services' JSON log lines, tracebacks) is pointed at the real stderr instead, so a service's
lines never take the pipe's detour: each took a second read, decode, match and write on the
reader thread (twice the CPU per line: bench.micro.log_cost). Lines of the two
sources may interleave in another order than they were written. `close` (at exit) puts fd 2
back and waits for the reader to drain, so a last line written before exit is not lost.
Only the service entry points install it (`shared.service_main.main`); tests and tools never do.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import re
import sys
import threading

# I1201 13:26:17.782330   14341 ssl_transport_security.cc:2563] message
_CORE_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([\w.\-/]+):\d+\] (.*)$")
_HANDSHAKE = re.compile(r"Handshake failed with error (?:SSL_ERROR_SSL: )?(?:error:\w+:SSL routines:OPENSSL_internal:)?(.*)")
_LEVELS = {"W": "warning", "E": "error", "F": "critical"}


class CoreLog:
    def __init__(self, service: str):
        self.service = service
        self.handshake_failures = 0
        self._saved = -1
        self._reader: threading.Thread | None = None

    def install(self) -> None:
        """Route fd 2 through the reader (idempotent)."""
        if self._reader is not None:
            return
        sys.stderr.flush()
        read, write = os.pipe()
        self._saved = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        sys.stderr = _Direct(os.dup(self._saved))
        self._reader = threading.Thread(target=self._pump, args=(read,), name="grpc-core-log", daemon=True)
        self._reader.start()
        atexit.register(self.close)

    def close(self) -> None:
        if self._reader is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)  # the pipe's last write end closes: the reader sees EOF after the rest
        self._reader.join(timeout=2.0)
        self._reader = None

    def _pump(self, read: int) -> None:
        """Drain the pipe until EOF whatever happens to a line: a reader that stopped would block
        every writer of stderr once the pipe is full."""
        with os.fdopen(read, "rb") as lines:
            for raw in lines:
                try:
                    out = self.translate(raw.decode("utf-8", "replace").rstrip("\n"))
                    data = b"" if out is None else out.encode() + b"\n"
                except Exception:
                    data = raw
                if data:
                    with contextlib.suppress(OSError):  # stderr's reader went away: keep draining
                        os.write(self._saved, data)

    def translate(self, line: str) -> str | None:
        """The line to write for one line read from fd 2 (None: drop it)."""
        m = _CORE_LINE.match(line)
        if m is None:
            return line
        level, source, message = m.groups()
        handshake = _HANDSHAKE.search(message)
        if handshake:
            self.handshake_failures += 1
            return self._json("tls.handshake_failed", "warning", error=handshake.group(1)[:300], source=source)
        if level == "I":
            return None
        return self._json("grpc.core", _LEVELS[level], message=message[:500], source=source)

    def _json(self, event: str, level: str, **fields) -> str:
        stamp = datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")
        return json.dumps({**fields, "event": event, "service": self.service, "level": level, "timestamp": stamp})


class _Direct:
    """Python's sys.stderr once installed: lines go straight to the real stderr, line-buffered, as
    a terminal's stderr is. When whoever reads stderr has gone away (a closed pipe: EPIPE), a line
    is lost instead of raising into the code that logged it, as the core-log reader also drops
    what it cannot write: a log line never fails a request."""

    def __init__(self, fd: int):
        self._file = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")

    def write(self, text: str) -> int:
        try:
            return self._file.write(text)
        except (OSError, ValueError):
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._file.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding, ...: the file's own
        return getattr(self._file, name)


CORE_LOG: CoreLog | None = None  # the process's, once a service entry point installed it


def install(service: str) -> CoreLog:
    global CORE_LOG
    if CORE_LOG is None:
        CORE_LOG = CoreLog(service)
        CORE_LOG.install()
    return CORE_LOG
