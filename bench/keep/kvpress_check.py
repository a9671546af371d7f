"""Are shared.keep's scores NVIDIA kvpress' scores on the same tensors? Two halves, two venvs
(kvpress 0.5.4 pins transformers < 5.3; this project runs 5.24). `make kvpress-check` builds that
venv (outside the checkout) and runs both halves:

    # 1. in the project's venv: one real.tasks test context through P = smollm2-135m, saving per
    #    checked layer the attention module's input, K/V, transformers' eager attention
    #    probabilities and shared.keep's scores
    python -m bench.keep.kvpress_check dump --out /tmp/keep-kvpress.pt
    # 2. in a venv with kvpress (its own transformers; torch may be shared): kvpress' presses
    #    score the same tensors (SnapKV through its own query path on the layer's attention module,
    #    loaded by that transformers from the same checkpoint), compared with ours
    ~/.cache/scd/kvpress/bin/python bench/keep/kvpress_check.py check /tmp/keep-kvpress.pt \\
        --model-dir .cache/models/smollm2-135m --out bench/results/real/keep-kvpress.json

Per policy and layer: the max abs difference of the scores (streaming: kvpress' scores depend on
the budget, so only its keep set is compared) and, at 25 % and 50 % kept, whether the keep sets
per KV head are equal, or equal up to tied scores (topk breaks ties as it likes; ours: shared.keep.select with sinks=0 and window=0, since kvpress' presses
protect nothing beyond what their scores do; streaming with 4 sinks, as StreamingLLMPress): key
norms tie exactly where a token repeats at layer 0 (RoPE keeps the norm). Exit status 1 unless
every score is within 1e-5 (relative) and every keep set equal up to ties.
The check half imports only torch, transformers and kvpress.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

LAYERS = (0, 7, 15, 22, 29)
FRACTIONS = (0.25, 0.5)


def dump(out: str, context_tokens: int) -> None:
    from real import tasks
    from shared import kv
    from shared.keep import policy
    from shared.keep.select import Budget, keep_indices
    from shared.models import load_model

    torch.set_num_threads(1)
    loaded = load_model("smollm2-135m", "float32", "cpu")
    ids = next(iter(tasks.examples(loaded.tokenizer, "test", 1, context_tokens))).context_ids
    states, _ = kv.capture_states(loaded, ids, kv.Capture.KV | kv.Capture.NORMED)
    loaded.model.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = loaded.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    ours = {name: policy.layer_scores(make(), loaded, states) for name, make in policy.POLICIES.items()}
    layers = {}
    for layer in LAYERS:
        keys, values = states[layer].kv()
        sinks = {"streaming": 4}
        layers[layer] = {
            "hidden_states": states[layer].normed.clone(),  # [T, d]: the attention module's input
            "keys": keys.clone(),
            "values": values.clone(),
            "attentions": attentions[layer][0].clone(),  # [H, T, T]
            "scores": {name: s[layer] for name, s in ours.items()},
            "keep": {
                f"{name}:{f}": keep_indices(s[layer], Budget(fraction=f).kept(len(ids)), sinks.get(name, 0), 0)
                for name, s in ours.items()
                for f in FRACTIONS
            },
        }
    torch.save({"ids": ids, "layers": layers}, out)
    print(f"{len(LAYERS)} layers of a {len(ids)}-token context -> {out}")


def check(path: str, model_dir: str, out: str | None) -> int:
    import transformers
    from kvpress import KnormPress, ObservedAttentionPress, SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    data = torch.load(path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    T = len(data["ids"])
    pos = torch.arange(T)[None]
    rows, ok = [], True
    for layer, d in data["layers"].items():
        module = model.model.layers[layer].self_attn
        hidden = d["hidden_states"][None]
        keys, values, attentions = d["keys"][None], d["values"][None], d["attentions"][None]
        kwargs = {"position_embeddings": model.model.rotary_emb(hidden, pos)}
        presses = {
            "knorm": lambda r: KnormPress(compression_ratio=r),
            "h2o": lambda r: ObservedAttentionPress(compression_ratio=r),
            "snapkv": lambda r: SnapKVPress(compression_ratio=r),  # attentions=None: its own query path
            "streaming": lambda r: StreamingLLMPress(compression_ratio=r),
        }
        for name, make in presses.items():
            row: dict = {"layer": layer, "policy": name}
            with torch.inference_mode():
                theirs = make(0.5).score(module, hidden, keys, values, attentions if name == "h2o" else None, kwargs)[0]
            if name != "streaming":
                diff = (theirs.float() - d["scores"][name]).abs().max().item()
                scale = theirs.float().abs().max().item()
                row["score_max_abs_diff"], row["score_max_abs"] = diff, scale
                ok &= diff <= 1e-5 * max(1.0, scale)
            for f in FRACTIONS:
                press = make(1 - f)
                with torch.inference_mode():
                    s = press.score(module, hidden, keys, values, attentions if name == "h2o" else None, kwargs)[0]
                n = int(T * f)  # ScorerPress.compress: int(k_len * (1 - compression_ratio))
                kv_keep = torch.sort(s.topk(n, dim=-1).indices, dim=-1).values
                mine = d["keep"][f"{name}:{f}"]
                same = torch.equal(kv_keep, mine)
                # topk breaks ties as it likes, shared.keep to the earlier token: where the sets
                # differ, the kept scores must be the same multiset (only tied tokens swapped)
                tied = torch.equal(s.gather(-1, kv_keep).sort(-1).values, s.gather(-1, mine).sort(-1).values)
                overlap = min(len(set(a.tolist()) & set(b.tolist())) / n for a, b in zip(kv_keep, mine))
                row[f"keep_equal@{f}"], row[f"keep_equal_up_to_ties@{f}"] = same, tied
                row[f"keep_min_overlap@{f}"] = round(overlap, 4)
                ok &= tied
            rows.append(row)
            print(json.dumps(row))
    import kvpress

    result = {
        "kind": "kvpress_check",
        "ok": ok,
        "kvpress": getattr(kvpress, "__version__", "0.5.4"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model_dir": model_dir,
        "context_tokens": T,
        "layers": list(data["layers"]),
        "rows": rows,
    }
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print("kvpress check:", "equal" if ok else "DIFFERENT")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--out", required=True)
    d.add_argument("--context-tokens", type=int, default=1024)
    c = sub.add_parser("check")
    c.add_argument("path")
    c.add_argument("--model-dir", required=True)
    c.add_argument("--out")
    args = parser.parse_args(argv)
    if args.step == "dump":
        dump(args.out, args.context_tokens)
        return 0
    return check(args.path, args.model_dir, args.out)


if __name__ == "__main__":
    sys.exit(main())
