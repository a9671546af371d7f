"""The chunk store's disk tier: one safetensors file per chunk entry under a directory, within a
byte budget (evicted by the same policy as RAM, producer.chunk_store.Index).

Writes are atomic (a temporary file in the same directory, then rename) and run on one writer
thread, never on the caller's. The writes waiting for that thread hold their tensors: at most
`queue_bytes` of tensor bytes wait (`queued_bytes`); a write that would go past it is skipped
and counted (`write_skipped`): the disk copy is lost, RAM keeps the entry as usual.

Each file's metadata carries the entry's key, parent, end position, a sha256 over all of it
(every tensor's name, dtype, shape and bytes, and the key, parent, end, order and token ids: a
header edited to another dtype or shape, or a metadata field changed, fails it), the tensors'
order in the entry (a read gives them back in it: a stored keep
transfer's layer is replayed in its payload order, producer.sources) and, for a chunk of a
context, its token ids and their sha256 (a chunk read back into RAM is announced in the KV
events with them). A read opens the file
once, reads its bytes and parses and checks those bytes in memory, so a file replaced or deleted
meanwhile (a rewrite, an eviction, another process on the same directory) is read whole, old or
new, never half of each. A file that does
not parse, names another key or fails its checksum is deleted and counted (`corrupt`), and the
caller falls back to the prefill: bad bytes are never served. A file gone between the index
check and the open is a miss, not corruption; a file of another size than the index holds is
dropped before it is read (memory stays bounded by the budget). On start the directory is scanned
(headers only; an entry that is not a readable file is skipped, never a failed start), so a
restarted producer serves what it had written; files past the budget (a smaller
budget than the last run's) are evicted by the policy then. Making room is all or nothing
(producer.chunk_store.Index.make_room): the files of the victims go with their index slots, or
nothing does.

The budget is this process's: two producers on one directory each keep theirs (together up to
twice it until the next start trims the directory), and a start deletes only temporary files old
enough not to be another process's write in progress.

Knows nothing about gRPC, models or codecs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from producer.chunk_store import ChunkEntry, Index, Slot
from shared import logs, torch_threads

log = logs.get("producer.disk_tier")
FORMAT = "scd.chunk.v2"  # v1's checksum covered tensor bytes only: its files are dropped, recomputed
SUFFIX = ".safetensors"
DEFAULT_QUEUE_BYTES = 256 << 20  # tensor bytes waiting for the writer thread, at most
STALE_TMP_S = 600.0  # a temporary file older than this at start is a crashed write, not a live one


def checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """sha256 of the tensors (name, dtype, shape, bytes, in name order) and the metadata fields a
    read trusts (key, parent, end, order, tokens)."""
    digest = hashlib.sha256()
    for field in ("key", "parent", "end", "order", "tokens"):
        digest.update(f"{field}={meta.get(field, '')}".encode() + b"\0")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def parse(data: bytes) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file's bytes, parsed in memory."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes: shorter than a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError(f"header of {size} bytes past the end of a {len(data)}-byte file")
    header = json.loads(data[8 : 8 + size])
    meta = header.get("__metadata__") or {} if isinstance(header, dict) else {}
    return meta, load_bytes(data)


class DiskTier:
    def __init__(self, directory: str | Path, budget_bytes: int, policy: str = "cost", queue_bytes: int = DEFAULT_QUEUE_BYTES):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.index = Index(budget_bytes, policy)
        self.corrupt = 0  # files dropped because they did not parse or failed their checksum
        self.format_dropped = 0  # files of an older format dropped at start (their entries are recomputed)
        self.queue_bytes = queue_bytes  # bound on queued_bytes
        self.queued_bytes = 0  # tensor bytes of the writes waiting for (or running on) the writer thread
        self.write_skipped = 0  # writes not queued: queued_bytes would have passed queue_bytes
        self._lock = threading.Lock()
        self._writer = torch_threads.pinned_pool(1, "producer-disk")  # beside the forward: no team of its own
        self._pending: set[str] = set()
        self._scan()

    def path(self, key: str) -> Path:
        return self.dir / f"{key}{SUFFIX}"

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:  # gone since the glob (another process evicted it), a dangling link: not ours to read
                st = path.stat()
            except OSError:
                continue
            if not path.is_file():  # a directory or other non-file under a chunk's name: left alone
                log.warning("disk_tier.skipped", file=path.name[:80], why="not a regular file")
                continue
            found.append((st.st_mtime, path))
        for _, path in sorted(found):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                if str(meta.get("format", "")).startswith("scd.chunk.") and meta.get("format") != FORMAT:
                    self.format_dropped += 1  # an older format's file: recomputed, not corruption
                    path.unlink(missing_ok=True)
                    continue
                if meta.get("format") != FORMAT or meta.get("key") != path.name[: -len(SUFFIX)]:
                    raise ValueError("not a chunk file of this format")
                slot = Slot(path.stat().st_size, meta["parent"], int(meta["end"]))
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            except Exception as exc:  # any unreadable header: drop the file
                self._drop_bad(path, f"scan: {exc}")
                continue
            self.index.add(meta["key"], slot)
        now = time.time()
        for stale in self.dir.glob(".*.tmp"):  # a write a crash interrupted (not another process's, in progress)
            with contextlib.suppress(OSError):
                if now - stale.stat().st_mtime > STALE_TMP_S:
                    stale.unlink(missing_ok=True)
        if self.format_dropped:
            log.info("disk_tier.format_dropped", files=self.format_dropped, format=FORMAT)
        over = self.index.over_budget()  # files of a larger budget (or another process): evicted by policy
        for key in over:
            self.path(key).unlink(missing_ok=True)
        if over:
            log.info("disk_tier.scan_evicted", files=len(over), budget_bytes=self.index.budget_bytes)

    def _drop_bad(self, path: Path, why: str) -> None:
        self.corrupt += 1
        log.warning("disk_tier.corrupt", file=path.name[:80], why=why[:200])
        with contextlib.suppress(OSError):  # already gone, or not a file: nothing more to drop
            path.unlink(missing_ok=True)

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self.index.slots

    def write(self, entry: ChunkEntry) -> None:
        """Queue an atomic write of the entry (skipped when already held or queued; skipped and
        counted when its tensors would take the queued bytes past queue_bytes)."""
        nbytes = entry.nbytes
        with self._lock:
            if entry.key in self.index.slots or entry.key in self._pending:
                return
            if self.queued_bytes + nbytes > self.queue_bytes:
                self.write_skipped += 1
                return
            self._pending.add(entry.key)
            self.queued_bytes += nbytes
        try:
            self._writer.submit(self._write, entry, nbytes)
        except RuntimeError:  # shut down: the process is stopping
            with self._lock:
                self._pending.discard(entry.key)
                self.queued_bytes -= nbytes

    def _write(self, entry: ChunkEntry, queued: int) -> None:
        final = self.path(entry.key)
        tmp = self.dir / f".{entry.key}.{uuid.uuid4().hex}.tmp"
        try:
            tensors = {name: t.contiguous() for name, t in entry.tensors.items()}
            meta = {
                "format": FORMAT,
                "key": entry.key,
                "parent": entry.parent,
                "end": str(entry.end),
                "order": json.dumps(list(tensors)),  # the entry's tensor order (a stream's payload order)
            }
            if entry.tokens:  # its token ids: read back, it is announced in KV events
                meta["tokens"] = json.dumps(list(entry.tokens))
            meta["sha256"] = checksum(tensors, meta)
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
                self.queued_bytes -= queued

    def read(self, key: str) -> ChunkEntry | None:
        """The entry, its checksum verified; None when it is not here (a miss) or bad (file
        dropped, counted). The file is opened once: its bytes are parsed and checked in memory."""
        path = self.path(key)
        with self._lock:
            slot = self.index.slots.get(key)
            if slot is None:
                return None
            size = slot.nbytes
        try:
            with open(path, "rb") as f:
                found = os.fstat(f.fileno()).st_size
                data = f.read(size + 1) if found == size else b""  # never more than the index's size
        except FileNotFoundError:  # evicted, or deleted, since the index check: a miss
            with self._lock:
                if key in self.index.slots and not path.exists():  # gone for good (the writer holds the lock)
                    self.index.drop(key)
            return None
        except OSError as exc:  # unreadable (permissions, I/O error): not served, the file stays
            log.warning("disk_tier.read_failed", key=key[:16], error=str(exc)[:200])
            return None
        if found != size or len(data) != size:
            with self._lock:
                now = self.index.slots.get(key)
                if now is None or now.nbytes != size:  # rewritten or evicted since: a miss, not corruption
                    return None
        try:
            if found != size or len(data) != size:
                raise ValueError(f"{found} bytes, the index holds {size} for it")
            meta, tensors = parse(data)
            del data
            if meta.get("format") != FORMAT or meta.get("key") != key or meta.get("sha256") != checksum(tensors, meta):
                raise ValueError("checksum, key or format mismatch")
            order = json.loads(meta.get("order") or "[]") or sorted(tensors)
            if sorted(order) != sorted(tensors):
                raise ValueError("tensor order names other tensors than the file holds")
            text = meta.get("tokens") or ""
            tokens = tuple(int(t) for t in json.loads(text or "[]"))
            entry = ChunkEntry(key, meta["parent"], int(meta["end"]), {name: tensors[name] for name in order}, tokens)
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
