"""The peer's side of `bench.peer.vs_vllm`: vLLM's offline engine (`vllm.LLM`) on one checkpoint, driven
by JSON lines on stdin, one JSON line per command on stdout. Runs under vLLM's own venv (never the
project's): it imports nothing from this repository.

    {"prompts": [[ids], ...], "max_tokens": N, "stop_token_ids": [ids]}
    -> {"wall_s": s, "outputs": [[ids], ...]}

Greedy, no prefix caching (every request prefills its prompt, as the services' side does). The
engine starts a process by spawn, hence the main guard.
"""

import json
import sys
import time


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    setup = json.loads(sys.argv[1])
    llm = LLM(
        model=setup["model"],
        dtype=setup["dtype"],
        max_model_len=setup["max_model_len"],
        max_num_seqs=setup["max_num_seqs"],
        enable_prefix_caching=False,
        seed=0,
    )
    print(json.dumps({"ready": True, "vllm": __import__("vllm").__version__}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        params = SamplingParams(
            temperature=0.0, max_tokens=command["max_tokens"], stop_token_ids=command["stop_token_ids"], detokenize=False
        )
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in command["prompts"]]
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        outputs = [list(r.outputs[0].token_ids) for r in results]
        print(json.dumps({"wall_s": wall, "outputs": outputs}), flush=True)


if __name__ == "__main__":
    main()
