"""glibc malloc's thresholds for the services' message buffers (`--malloc-mmap-threshold`).

Every received gRPC message (a Prefill stream's messages carry up to 4 MiB of payload each) and
every payload tensor made from one is a large, short-lived allocation. glibc serves an allocation above its
mmap threshold (128 KiB at start, raised by itself as large blocks are freed) with a fresh mmap
and gives it back with munmap: page faults and zeroed pages on every message. A fixed threshold
above the message size keeps those buffers in the heap, where the next message reuses them; the
trim threshold (twice the mmap threshold) bounds the free memory the heap keeps at its top.
bench.micro.transport measures it (`--malloc-mmap-threshold 0` is glibc's own behaviour).

Applied once at start-up, before the model loads. A C library that is not glibc (musl, macOS) is
left alone and says so. Knows nothing about the services.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
DEFAULT_MMAP_THRESHOLD = 32 << 20  # bytes; the largest value every 64-bit glibc accepts


def tune(mmap_threshold: int) -> str:
    """Set glibc's mmap threshold to `mmap_threshold` bytes and its trim threshold to twice that
    (0: leave glibc's dynamic defaults); a sentence saying what was done, for the start-up log."""
    if mmap_threshold <= 0:
        return "glibc's defaults (--malloc-mmap-threshold 0)"
    libc_name, version = platform.libc_ver()
    if libc_name != "glibc":
        return f"unchanged: the C library is not glibc ({libc_name or 'unknown'})"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold):
        return f"unchanged: glibc {version} refused an mmap threshold of {mmap_threshold} bytes"
    if not libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold):  # the mmap threshold stands
        return f"glibc {version}: mmap threshold {mmap_threshold} bytes; it refused a trim threshold of {2 * mmap_threshold}"
    return f"glibc {version}: mmap threshold {mmap_threshold} bytes, trim threshold {2 * mmap_threshold} bytes"
