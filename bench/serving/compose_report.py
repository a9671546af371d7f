"""What one `make compose-smoke` run's observations mean: the report line and whether it passed.

docker/compose_smoke.py gathers the observations (it owns Docker, the stack and the clients) and
calls `verdict`; it records both files on a passing run (bench/results/compose-run.json, the
observations; bench/results/compose.json, the report docs/results.md quotes), and
tests/test_compose_report.py runs `verdict` on that recording, so the check is tested without
Docker. The modes the demo must have answered are the demo's own list (bench.demo.modes_asked over
the codecs the consumer described), so the check cannot drift from the demo.
"""

from __future__ import annotations

from bench.demo import modes_asked


def kernel_built(decode_attention: str) -> bool:
    """The consumer's Describe.decode_attention says the paged kernel was built: it runs ("kernel
    avx512"), or auto chose per-row SDPA for this dtype and head size beside a built kernel."""
    return decode_attention.startswith("kernel ") or (decode_attention.startswith("sdpa: auto:") and decode_attention.endswith(" built"))


def verdict(run: dict) -> tuple[dict, bool]:
    """(report, passed) for a run's observations:
    images_built, healthy_after_s, producers_expected, producers_healthy; codecs and has_artifact
    (what the demo was shown), rows (its JSON lines); http (the `openai` client's completion over the
    published HTTP port: model, models, text, completion_tokens, gold); kv_events (event types in
    order, replayed from sequence 0 over the published replay port); decode_attention (the consumer's
    Describe: what its decode rows attend with; the image builds the kernel, so "kernel ..." is
    required); prefills_by_producer, stop_s, stop_exit_codes."""
    rows = run.get("rows", [])
    asked = modes_asked(run.get("codecs", []), run.get("has_artifact", False))
    modes = [r["mode"] for r in rows]
    http = run.get("http") or {}
    events = run.get("kv_events") or []
    report = {
        "images_built": run.get("images_built", 0),
        "healthy_after_s": run.get("healthy_after_s"),
        # every mode the demo asks answered, once, with tokens
        "demo_modes_ok": bool(rows) and sorted(modes) == sorted(asked) and all(r["tokens"] > 0 for r in rows),
        "producers": run.get("producers_healthy", 0),
        "modes": modes,
        "scd_match_oracle": next((r["match_oracle"] for r in rows if r["mode"] == "scd"), None),
        # the openai client over the published HTTP port: the served model, answered in the task's format
        "http_ok": (
            http.get("completion_tokens", 0) > 0
            and http.get("model") in http.get("models", [])
            and bool(http.get("gold"))
            and http.get("text", "").split()[: len(http["gold"].split())] == http["gold"].split()
        ),
        "http_text": http.get("text"),
        # KV events over the published ports: the start's AllBlocksCleared first, then the demo's blocks
        "kv_events_ok": events[:1] == ["AllBlocksCleared"] and "BlockStored" in events,
        "kv_events": {kind: events.count(kind) for kind in dict.fromkeys(events)},
        # the consumer container's decode rows through the paged kernel its image built
        "decode_attention": run.get("decode_attention", ""),
        "prefills_by_producer": run.get("prefills_by_producer", []),
        "stop_s": run.get("stop_s"),
        "stop_exit_codes": run.get("stop_exit_codes", []),
    }
    passed = (
        report["images_built"] == 2
        and report["demo_modes_ok"]
        and report["producers"] == run.get("producers_expected")
        and report["http_ok"]
        and report["kv_events_ok"]
        and kernel_built(report["decode_attention"])
        and bool(report["stop_exit_codes"])
        and set(report["stop_exit_codes"]) == {0}
    )
    return report, passed
