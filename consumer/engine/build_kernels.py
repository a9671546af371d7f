"""`python -m consumer.engine.build_kernels` (`make kernel`, the consumer image): build the engine's CPU
extensions now, so no request waits for a compile: the paged decode kernel
(consumer.engine.paged_attention), where the CPU runs them the bfloat16 prefill kernel
(consumer.engine.prefill_attention) and the forward's fused elementwise ops
(consumer.engine.fused_ops). Prints what each runs; exits 1 where a C++ compiler is here and a build
failed (no compiler: per-row SDPA and eager ops are this machine's path, not an error).
"""

from __future__ import annotations

import sys

from consumer.engine import fused_ops, paged_attention, prefill_attention


def main() -> int:
    decode, prefill, fused = paged_attention.which(), prefill_attention.which(), fused_ops.which()
    print(f"decode attention: {decode} ({paged_attention.build_dir(paged_attention._flags()[0])})")
    print(f"prefill attention: {prefill}")
    print(f"elementwise ops: {fused}")
    # a compiler is here and a build failed (no compiler: the eager / SDPA paths are this machine's)
    failed = paged_attention.compiler() is not None and (
        prefill.startswith(prefill_attention.NOT_BUILT) or fused.startswith(fused_ops.NOT_BUILT)
    )
    return 1 if paged_attention.build_failed() or failed else 0


if __name__ == "__main__":
    sys.exit(main())
