"""Run by tests/test_kv_events.py with the Python of the venv `make vllm-structs` makes, never imported
by the project: decodes event payloads with an installed vLLM's own structs
(vllm.distributed.kv_events.KVEventBatch) and computes block hashes with its own functions.

stdin: {"payloads": [hex, ...], "hashes": [{"algo", "seed", "block_size", "token_ids"}, ...]}.
stdout: {"version", "file", "decoded": [{"events": [{"type", field: value, ...}], "ts",
"data_parallel_rank"} or {"error": message}], "hashes": [[int, ...], ...]}. Each seed reaches vLLM
as in production, through the PYTHONHASHSEED variable its init_none_hash reads (null: unset).
"""

from __future__ import annotations

import json
import os
import sys

import msgspec
import vllm
from vllm.distributed import kv_events


def event_fields(event) -> dict:
    return {"type": type(event).__name__, **{f: getattr(event, f) for f in event.__struct_fields__}}


def decode(payloads: list[str]) -> list[dict]:
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    out = []
    for payload in payloads:
        try:
            batch = decoder.decode(bytes.fromhex(payload))
        except msgspec.ValidationError as e:
            out.append({"error": str(e)})
            continue
        out.append({"ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
                    "events": [event_fields(e) for e in batch.events]})
    return out


def block_hashes(algo: str, seed: str | None, block_size: int, token_ids: list[int]) -> list[int]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    os.environ.pop("PYTHONHASHSEED", None)
    if seed is not None:
        os.environ["PYTHONHASHSEED"] = seed
    fn = get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)  # NONE_HASH = fn(PYTHONHASHSEED, or its default when unset)
    parent, out = None, []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = kcu.hash_block_tokens(fn, parent, token_ids[i : i + block_size])
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


def main() -> None:
    ask = json.load(sys.stdin)
    answer = {"version": vllm.__version__, "file": kv_events.__file__, "decoded": decode(ask["payloads"])}
    answer["hashes"] = [block_hashes(h["algo"], h["seed"], h["block_size"], h["token_ids"]) for h in ask.get("hashes", [])]
    print(json.dumps(answer, default=lambda o: o.hex() if isinstance(o, bytes) else repr(o)))


if __name__ == "__main__":
    main()
