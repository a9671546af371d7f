"""The chunk store's disk tier: one safetensors file per chunk entry under a directory, within a
byte budget (evicted by the same policy as RAM, producer.chunk_store.Index).

Writes are atomic (a temporary file in the same directory, then rename) and run on one writer
thread, never on the caller's. Each file's metadata carries the entry's key, parent, end
position and a sha256 of its tensors' bytes (name order), verified on every read: a file that
does not parse, names another key or fails its checksum is deleted and counted (`corrupt`),
and the caller falls back to the prefill: bad bytes are never served. On start the directory
is scanned (headers only), so a restarted producer serves what it had written.

Knows nothing about gRPC, models or codecs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import threading
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from producer.chunk_store import ChunkEntry, Index, Slot
from shared import logs

log = logs.get("producer.disk_tier")
FORMAT = "scd.chunk.v1"
SUFFIX = ".safetensors"


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(name.encode() + b"\0")
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class DiskTier:
    def __init__(self, directory: str | Path, budget_bytes: int, policy: str = "cost"):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = Index(budget_bytes, policy)
        self.corrupt = 0  # files dropped because they did not parse or failed their checksum
        self._lock = threading.Lock()
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="producer-disk")
        self._pending: set[str] = set()
        self._scan()

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _scan(self) -> None:
        for path in sorted(self.dir.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                if meta.get("format") != FORMAT or meta.get("key") != path.name[: -len(SUFFIX)]:
                    raise ValueError("not a chunk file of this format")
                slot = Slot(path.stat().st_size, meta["parent"], int(meta["end"]))
            except Exception as exc:  # any unreadable header: drop the file
                self._drop_bad(path, f"scan: {exc}")
                continue
            self.index.add(meta["key"], slot)
        for stale in self.dir.glob(".*.tmp"):  # a write a crash interrupted
            stale.unlink(missing_ok=True)

    def _drop_bad(self, path: Path, why: str) -> None:
        self.corrupt += 1
        log.warning("disk_tier.corrupt", file=path.name, why=why[:200])
        path.unlink(missing_ok=True)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self.index.slots

    def write(self, entry: ChunkEntry) -> None:
        """Queue an atomic write of the entry (skipped when already held or queued)."""
        with self._lock:
            if entry.key in self.index.slots or entry.key in self._pending:
                return
            self._pending.add(entry.key)
        with contextlib.suppress(RuntimeError):  # shut down: the process is stopping
            self._writer.submit(self._write, entry)

    def _write(self, entry: ChunkEntry) -> None:
        final = self.path(entry.key)
        tmp = self.dir / f".{entry.key}.{uuid.uuid4().hex}.tmp"
        try:
            tensors = {name: t.contiguous() for name, t in entry.tensors.items()}
            meta = {
                "format": FORMAT,
                "key": entry.key,
                "parent": entry.parent,
                "end": str(entry.end),
                "sha256": checksum(tensors),
            }
            save_file(tensors, str(tmp), metadata=meta)
            nbytes = tmp.stat().st_size
            with self._lock:
                if nbytes > self.index.budget_bytes:
                    return
                evicted = self.index.make_room(entry.key, entry.parent, nbytes)
                if evicted is None:
                    return
                for key in evicted:
                    self.path(key).unlink(missing_ok=True)
                os.replace(tmp, final)
                self.index.add(entry.key, Slot(nbytes, entry.parent, entry.end))
        except Exception as exc:  # a failed write loses only the disk copy
            log.warning("disk_tier.write_failed", key=entry.key[:16], error=str(exc)[:200])
        finally:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self._pending.discard(entry.key)

    def read(self, key: str) -> ChunkEntry | None:
        """The entry, its checksum verified; None (file dropped, counted) when it is bad."""
        path = self.path(key)
        with self._lock:
            if key not in self.index.slots:
                return None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
            if meta.get("key") != key or meta.get("sha256") != checksum(tensors):
                raise ValueError("checksum or key mismatch")
            entry = ChunkEntry(key, meta["parent"], int(meta["end"]), tensors)
        except Exception as exc:  # truncated, flipped, unparsable: never served
            with self._lock:
                self.index.drop(key)
            self._drop_bad(path, str(exc))
            return None
        with self._lock:
            if key in self.index.slots:
                self.index.touch(key)
        return entry

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for the writes queued so far (tests, shutdown)."""
        self._writer.submit(lambda: None).result(timeout=timeout_s)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
