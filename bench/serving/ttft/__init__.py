"""`python -m bench.serving.ttft`: time to first token per transfer mode, under shaped bandwidth.

Topology (shaped, the default; needs root, `ip`, `tc`):

    root ns: this process builds the link (bench.harness.netns), re-runs itself inside the consumer's
             namespace, and removes the link when that ends (also on failure, Ctrl-C, SIGTERM)
    scd-bench-p (10.99.0.1): producer  ==tc-shaped veth==  scd-bench-c (10.99.0.2): consumer,
                                                           and the benchmark client (this code)

The client runs in the consumer's namespace, next to the consumer, as a decode-side router
would; only producer -> consumer traffic crosses the shaped link. `--no-shaping` runs both
services and the client on loopback (no root; the CI smoke test).

Grid: model scales x bandwidths x contexts x stores (cold: every request a context the producer
has never seen; warm: the same context again, counted only when the producer reports a store
hit). Per (bandwidth, context, store) the modes are measured interleaved: `--warmup` then
`--runs` repetitions, each running every mode once in rotating order. The oracle uses no link:
measured once per context, reported with bandwidth_mbit null, and followed by the `cached`
reference row (a consumer with the context cached itself: question prefill only).

One JSON line per cell, to stdout and to `--out` (bench/results/ttft.jsonl): model, shaping,
bandwidth_mbit, ctx_tokens, mode, schedule, store (cold|warm), ttft_ms_median/min/max, runs,
bytes, efficiency, ttft_lower_bound_ms, load_avg_1m (median over the cell's requests),
load_avg_1m_max, cores, load_above_cores, order, then the TTFT breakdown (medians, ms):
producer_prefill_ms, producer_encode_ms, wire_ms (bytes / sustained link rate), transfer_ms
(producer call to last layer rebuilt), rebuild_ms (consumer decode work, overlaps transfer),
question_prefill_ms, first_token_ms (ttft - transfer - question prefill), decode_step_ms; and
link_mbit, link_burst_bytes, raw_kv_bytes, dtype, f1/em (trained pair only).

efficiency = lower bound / measured TTFT, lower bound = max(producer forward, its encode, (payload bytes -
shaper burst) / sustained link rate) + question prefill (formula and why no correct run beats
it: bench.serving.ttft.report). A row above 1.05 fails the run (exit status 3).

Modules: grid (flags' syntax, grids, order), links (loopback / shaped link, outer process),
measure (services and the interleaved loop), report (rows, bound, check, output), plot (the
figure and markdown table of the rows: `python -m bench.serving.ttft.plot`), cli.
"""
