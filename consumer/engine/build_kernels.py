"""`python -m consumer.engine.build_kernels` (`make kernel`, the consumer image): build the engine's CPU
attention kernels now, so no request waits for a compile: the paged decode kernel
(consumer.engine.paged_attention) and, where the CPU runs it, the bfloat16 prefill kernel
(consumer.engine.prefill_attention), and the forward's fused elementwise ops (consumer.engine.fused_ops). Prints what each row kind runs; exits 1 where a C++ compiler is
here and a build failed (no compiler: per-row SDPA is this machine's path, not an error).
"""

from __future__ import annotations

import sys

from consumer.engine import fused_ops, paged_attention, prefill_attention


def main() -> int:
    decode, prefill = paged_attention.which(), prefill_attention.which()
    print(f"decode attention: {decode} ({paged_attention.build_dir(paged_attention._flags()[0])})")
    fused = fused_ops.which()
    print(f"prefill attention: {prefill}")
    print(f"elementwise ops: {fused}")
    compiler = paged_attention.compiler() is not None
    prefill_failed = prefill.startswith(prefill_attention.NOT_BUILT) and compiler
    fused_failed = fused.startswith(f"eager: {fused_ops.NAME} not built") and compiler
    return 1 if paged_attention.build_failed() or prefill_failed or fused_failed else 0


if __name__ == "__main__":
    sys.exit(main())
