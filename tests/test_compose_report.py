"""`make compose-smoke`'s check without Docker: bench.serving.compose_report.verdict on the observations the
last passing run recorded (bench/results/compose-run.json), and on that recording with one thing
wrong. The demo's modes come from the demo itself (bench.demo.modes_asked), so a mode the demo
adds (as it added `default`) cannot make a passing stack fail the check, and a mode it skips fails.
Also: the compose file publishes, and the images EXPOSE, the ports the consumer serves."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from bench.demo import DEFAULT, modes_asked
from bench.serving.compose_report import verdict

ROOT = Path(__file__).resolve().parent.parent
RUN = json.loads((ROOT / "bench/results/compose-run.json").read_text())


def test_the_recorded_run_passes_and_is_the_committed_figure():
    report, passed = verdict(RUN)
    assert passed, report
    assert report == json.loads((ROOT / "bench/results/compose.json").read_text())
    assert report["modes"][0] == DEFAULT and sorted(report["modes"]) == sorted(modes_asked(RUN["codecs"], True))
    assert report["http_ok"] and report["kv_events_ok"]


def broken(change) -> dict:
    run = copy.deepcopy(RUN)
    change(run)
    return run


@pytest.mark.parametrize(
    "why, change",
    [
        ("the default's row missing", lambda r: r["rows"].pop(0)),
        ("a mode without tokens", lambda r: r["rows"][-1].update(tokens=0)),
        ("a codec the demo did not ask", lambda r: r["codecs"].append("newcodec")),
        ("a mode asked twice", lambda r: r["rows"].append(r["rows"][1])),
        ("no demo rows", lambda r: r.update(rows=[])),
        ("one image", lambda r: r.update(images_built=1)),
        ("a producer unhealthy", lambda r: r.update(producers_healthy=r["producers_expected"] - 1)),
        ("the HTTP answer wrong", lambda r: r["http"].update(text=" " + " ".join(reversed(r["http"]["gold"].split())) + " .")),
        ("the HTTP answer empty", lambda r: r["http"].update(text="", completion_tokens=0)),
        ("another model over HTTP", lambda r: r["http"].update(model="other")),
        ("no HTTP call", lambda r: r.pop("http")),
        ("the events not cleared first", lambda r: r.update(kv_events=r["kv_events"][1:])),
        ("no stored block", lambda r: r.update(kv_events=[e for e in r["kv_events"] if e != "BlockStored"])),
        ("a container killed", lambda r: r["stop_exit_codes"].append(137)),
        ("never stopped", lambda r: r.update(stop_exit_codes=[])),
        ("decode rows on per-row SDPA", lambda r: r.update(decode_attention="sdpa: scd_decode_attention_avx512 not built")),
        ("decode attention not reported", lambda r: r.pop("decode_attention")),
    ],
)
def test_a_run_with_one_thing_wrong_fails(why, change):
    report, passed = verdict(broken(change))
    assert not passed, why


def test_the_check_takes_the_demo_s_modes_not_a_fixed_set():
    """Without an artifact the demo skips scd: a run without scd's row then passes."""
    run = broken(lambda r: r.update(has_artifact=False, rows=[row for row in r["rows"] if row["mode"] != "scd"]))
    assert verdict(run)[1]
    assert not verdict(broken(lambda r: r.update(has_artifact=False)))[1]  # scd answered but not asked


def test_compose_publishes_and_the_images_expose_what_the_consumer_serves():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("consumer", "consumer-gpu"):
        published = {int(str(p).rsplit(":", 1)[1]) for p in services[name]["ports"]}
        assert published == {50052, 8000, 5557, 5558}, name
        env = services[name]["environment"]
        assert env["SCD_CONSUMER_KV_EVENTS_REPLAY_ENDPOINT"] == "${SCD_KV_EVENTS_REPLAY_ENDPOINT:-}"
    for image, ports in (("consumer", {50052, 8000, 5557, 5558}), ("producer", {50051, 5557, 5558})):
        text = (ROOT / f"docker/{image}.Dockerfile").read_text()
        (line,) = re.findall(r"^EXPOSE (.*)$", text, re.M)
        assert set(map(int, line.split())) == ports, image
    guide = (ROOT / "docs/operations.md").read_text()
    section = guide[guide.index("## Docker Compose") : guide.index("## Kubernetes")]
    for needed in ("8000", "5557", "5558", "SCD_KV_EVENTS_ENDPOINT", "OpenAI"):
        assert needed in section, needed


def test_a_built_kernel_that_auto_left_aside_still_passes():
    from bench.serving.compose_report import kernel_built

    assert kernel_built("kernel avx2")
    assert kernel_built("sdpa: auto: float32 with head_dim 32 < 64 (per-row SDPA measured faster); kernel avx512 built")
    assert not kernel_built("sdpa: auto: float32 with head_dim 32 < 64 (per-row SDPA measured faster); sdpa: no compiler")
    assert not kernel_built("sdpa: scd_decode_attention_avx512 not built")
