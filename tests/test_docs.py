"""The docs stay true to the code: every configuration field is documented, every make target the
README names exists, and every relative link points at a file."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from shared.config import ConsumerConfig, ProducerConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("config", [ProducerConfig, ConsumerConfig])
def test_every_config_field_is_in_the_operations_doc(config):
    text = (ROOT / "docs/operations.md").read_text()
    missing = [f.name for f in dataclasses.fields(config) if f"--{f.name.replace('_', '-')}" not in text]
    assert missing == []


def test_make_targets_named_in_the_readme_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, re.M))
    named = set(re.findall(r"`(?:sudo )?make ([a-z][a-z0-9-]*)", (ROOT / "README.md").read_text()))
    assert named and named - targets == set()


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "docs/results.md", "docs/operations.md"])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
        assert (path.parent / target).exists(), f"{doc}: {target}"


# -- the docs' code blocks run (issue 19) ---------------------------------------------------------
def code_blocks(doc: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", (ROOT / doc).read_text(), re.M | re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/operations.md"])
async def test_python_blocks_run_as_pasted_against_a_running_consumer(doc, tmp_path):
    """Each ```python block, unchanged but for the consumer's address, runs to the end against a
    real pair (its own event loop: `asyncio.run` in a thread)."""
    import asyncio
    import contextlib
    import io

    from tests.conftest import running_pair

    blocks = code_blocks(doc, "python")
    assert blocks, f"{doc} has no python block"
    async with running_pair("tiny-llama", consumer_kw={"http_port": 0}) as pair:
        for block in blocks:
            code = block.replace("127.0.0.1:50052", pair.consumer.address)
            code = code.replace("127.0.0.1:8000", f"127.0.0.1:{pair.consumer.http_port}")  # the openai client's
            out = io.StringIO()

            def run(code=code, out=out):
                with contextlib.redirect_stdout(out):
                    exec(compile(code, doc, "exec"), {"__name__": "__main__"})

            await asyncio.to_thread(run)
            assert out.getvalue().strip(), f"{doc}: a python block printed nothing"


async def test_the_certificate_recipe_serves_a_request_over_mtls(tmp_path):
    """The guide's openssl recipe, run as written, gives certificates a producer (mTLS) and a
    consumer accept: one request crosses the hop."""
    import shutil
    import subprocess

    from consumer.server import ConsumerServer
    from producer.server import ProducerServer
    from tests.conftest import ConsumerClient, prompt

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    (recipe,) = [b for b in code_blocks("docs/operations.md", "sh") if "openssl req -x509" in b]
    subprocess.run(["bash", "-euc", recipe], cwd=tmp_path, check=True, capture_output=True, timeout=120)
    files = {name: str(tmp_path / name) for name in ("ca.pem", "producer.pem", "producer.key", "consumer-client.pem",
                                                      "consumer-client.key")}
    producer_kw = dict(tls_cert=files["producer.pem"], tls_key=files["producer.key"], tls_client_ca=files["ca.pem"])
    consumer_kw = dict(producer_tls_ca=files["ca.pem"], producer_tls_cert=files["consumer-client.pem"],
                       producer_tls_key=files["consumer-client.key"], default_mode="raw")
    common = dict(port=0, model="tiny-llama", device="cpu", drain_grace_s=0)
    producer = ProducerServer(ProducerConfig(**common, **producer_kw))
    await producer.start()
    await producer.load()
    consumer = ConsumerServer(ConsumerConfig(**common, producer=producer.address, **consumer_kw))
    await consumer.start()
    await consumer.load()
    try:
        async with ConsumerClient(consumer.address) as client:
            answer = await client.generate(timeout=60, context=prompt("a b c d"), question=prompt(" e"), max_new_tokens=2)
        assert answer.stats.transfer.name == "raw" and answer.stats.bytes_received > 0
        assert consumer.link is not None and consumer.link.state.state == "ok"
    finally:
        await consumer.stop(0)
        await producer.stop(0)


def test_the_guide_names_the_cache_dir_and_the_readme_runs_the_trained_pair():
    guide, readme = (ROOT / "docs/operations.md").read_text(), (ROOT / "README.md").read_text()
    assert "SCD_CACHE_DIR" in guide
    assert "-m producer --model checkpoints/qa-base --port 50051" in readme  # the default --dtype auto
    assert "on_transfer_failure=2" not in readme and "asyncio.run(" in readme


def test_the_readme_runs_the_trained_pair_by_hand():
    """The README's commands for the trained pair, run as written (on free ports): both services
    start, the consumer becomes SERVING, and the demo's SCD answer equals the oracle's."""
    import json
    import subprocess

    from bench.harness.services import free_port

    if not (ROOT / "checkpoints/qa-base/config.json").exists() or not (ROOT / "artifacts/qa-base-to-tuned.safetensors").exists():
        pytest.skip("the trained pair is not in this checkout")
    (block,) = [b for b in code_blocks("README.md", "sh") if "-m consumer --model checkpoints/qa-tuned" in b]
    block = block.replace("50051", str(free_port())).replace("50052", str(free_port()))
    script = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n" + block
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["mode"]: row for row in map(json.loads, proc.stdout.splitlines()) if "mode" in row}
    assert rows["scd"]["match_oracle"] and rows["scd"]["bytes"] < rows["raw"]["bytes"]
