"""What a service's memory is made of, on request: a diagnostic behind the environment variable
SCD_HEAP_TRACE=<directory> (off when unset; never on in production, tracemalloc slows every
allocation).

When set, the service starts tracemalloc (SCD_HEAP_TRACE_FRAMES frames per allocation, default
TRACE_FRAMES; 0: no tracemalloc, the dumps keep the rest) at start-up, and
each SIGUSR2 writes one numbered dump into the directory: `<service>-<pid>-<n>.tracemalloc` (the
snapshot, for tracemalloc.Snapshot.load / compare_to) and `<service>-<pid>-<n>.json`: RSS, live
Python objects counted by type, glibc's heap totals (mallinfo2: bytes in use, free inside the heap,
mmapped; arenas from malloc_info) and the snapshot's top allocation sites. bench.serving.load_test
(`--heap-trace DIR`) asks for one dump after each round and diffs them. Knows nothing about the
services' structures: it counts what is there.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import gc
import json
import os
import re
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

ENV = "SCD_HEAP_TRACE"
TRACE_FRAMES = 8  # frames per traced allocation: enough to see which structure holds a dict or a list
TOP = 40  # allocation sites and object types written to the JSON dump
CONTAINER_MIN_LEN = 32  # containers listed in a dump (shorter ones cannot hide much)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def malloc_totals() -> dict[str, int]:
    """glibc's heap, in bytes: `arena` (heap bytes from sbrk and arenas), `in_use` (allocated
    chunks), `free` (free chunks kept inside the heap), `mmapped` (blocks above the mmap threshold),
    `arenas` (malloc_info's count); {} where the C library is not glibc >= 2.33."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    out = {"arena": m.arena, "in_use": m.uordblks, "free": m.fordblks, "mmapped": m.hblkhd, "keepcost": m.keepcost}
    with tempfile.NamedTemporaryFile(suffix=".xml") as tmp:
        libc.fopen.restype = ctypes.c_void_p
        fp = libc.fopen(tmp.name.encode(), b"w")
        if fp:
            libc.malloc_info(0, ctypes.c_void_p(fp))
            libc.fclose(ctypes.c_void_p(fp))
            out["arenas"] = len(re.findall(r"<heap nr=", Path(tmp.name).read_text()))
    return out


def rss_kib(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def tensor_bytes() -> dict[str, int]:
    """CPU tensors reachable from Python (gc-tracked), by storage: their count and bytes (each
    storage once); {} when torch is not loaded."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    storages: dict[int, int] = {}
    count = 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":  # type(): no proxy objects asked
            count += 1
            with contextlib.suppress(Exception):  # a tensor without storage (meta, sparse)
                s = o.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
    return {"tensors": count, "storages": len(storages), "bytes": sum(storages.values())}


def _owner(container: object, skip: set[int]) -> str:
    """Where a container hangs: `Class.attribute` of the object that holds it as an attribute,
    `module.name` of a module global, `dict[key]` or the type of another container that holds it
    (`skip`: ids of the caller's own lists of objects, referrers of everything)."""
    for ref in gc.get_referrers(container):
        if id(ref) in skip or type(ref).__name__ in ("frame", "cell"):
            continue
        if isinstance(ref, dict):
            key = next((k for k, v in ref.items() if v is container), None)
            for holder in gc.get_referrers(ref):
                if id(holder) not in skip and getattr(holder, "__dict__", None) is ref:
                    name = holder.__name__ if isinstance(holder, type(gc)) else type(holder).__qualname__
                    return f"{name}.{key}"
            return f"dict[{str(key)[:60]}]"
        attrs = getattr(ref, "__dict__", None) if not isinstance(ref, type) else None
        slots = [n for k in type(ref).__mro__ for n in getattr(k, "__slots__", ())]
        named = {n: getattr(ref, n, None) for n in slots} | (attrs if isinstance(attrs, dict) else {})
        attr = next((n for n, v in named.items() if v is container), None)
        return f"{type(ref).__qualname__}.{attr}" if attr else type(ref).__qualname__
    return "?"


_seen: dict[int, int] = {}  # container id -> its length at the previous dump


def containers(min_len: int = CONTAINER_MIN_LEN, top: int = TOP) -> list[dict[str, Any]]:
    """Every gc-tracked dict, list, set or deque with at least min_len entries: its id (the same
    across dumps while it lives), type and length; and for the `top` that gained the most entries
    since the previous dump (new ones count whole), its owner (_owner: a walk over every object,
    so only for those)."""
    kinds = (dict, list, set, collections.deque)
    everything = gc.get_objects()
    big = [o for o in everything if issubclass(type(o), kinds) and len(o) >= min_len]
    lens = [len(o) for o in big]
    out: list[dict[str, Any]] = [{"id": id(o), "type": type(o).__qualname__, "len": n} for o, n in zip(big, lens, strict=True)]
    gained = [n - _seen.get(id(o), 0) for o, n in zip(big, lens, strict=True)]
    grew = sorted(range(len(big)), key=gained.__getitem__, reverse=True)[:top]
    for i in grew:
        if gained[i] > 0:
            out[i]["owner"] = _owner(big[i], {id(everything), id(big)})
    _seen.clear()
    _seen.update((id(o), n) for o, n in zip(big, lens, strict=True))
    del everything, big
    return out


def threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


def objects_by_type(top: int | None = TOP) -> dict[str, int]:
    """Live objects the garbage collector tracks, counted by type (module.qualname), most first."""
    counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
    return dict(counts.most_common(top))  # top None: every type


def dump(directory: Path, service: str, n: int) -> Path:
    """Write dump number n (the snapshot and the JSON); returns the JSON's path."""
    stem = directory / f"{service}-{os.getpid()}-{n:03d}"
    gc.collect()
    sites = []
    if tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        snapshot.dump(f"{stem}.tracemalloc")
        sites = [
            {"site": str(s.traceback[0]), "kib": round(s.size / 1024, 1), "count": s.count}
            for s in snapshot.statistics("lineno")[:TOP]
        ]
        del snapshot  # not counted among the containers below
    traced, peak = tracemalloc.get_traced_memory()
    info: dict[str, Any] = {
        "service": service,
        "pid": os.getpid(),
        "n": n,
        "rss_kib": rss_kib(),
        "traced_kib": traced // 1024,
        "traced_peak_kib": peak // 1024,
        "malloc": malloc_totals(),
        "threads": threads(),
        "torch_cpu": tensor_bytes(),
        "containers": containers(),
        "objects": objects_by_type(None),
        "sites": sites,
    }
    path = Path(f"{stem}.json")
    Path(f"{stem}.part").write_text(json.dumps(info, indent=1))
    os.replace(f"{stem}.part", path)  # whole or absent: a reader polls for it
    return path


def install(service: str, loop: Any = None, env: dict[str, str] | None = None) -> Path | None:
    """Start tracing when SCD_HEAP_TRACE names a directory, with a SIGUSR2 handler on `loop` (an
    asyncio loop) that writes the next dump; the directory, or None when the variable is unset."""
    where = (os.environ if env is None else env).get(ENV, "")
    if not where:
        return None
    import signal

    directory = Path(where)
    directory.mkdir(parents=True, exist_ok=True)
    frames = int((os.environ if env is None else env).get(f"{ENV}_FRAMES", TRACE_FRAMES))
    if frames > 0 and not tracemalloc.is_tracing():
        tracemalloc.start(frames)
    count = iter(range(1_000_000))
    if loop is not None:
        loop.add_signal_handler(signal.SIGUSR2, lambda: dump(directory, service, next(count)))
    return directory
