"""The services as real processes (`python -m producer` / `python -m consumer`): configuration by
flags and environment, JSON logs carrying the request id on both sides, and SIGTERM draining
to a clean exit."""

from __future__ import annotations

import asyncio
import json

from bench.harness import services
from consumer.api.client import ConsumerClient, prompt


def test_processes_log_request_id_and_exit_cleanly_on_sigterm(tmp_path, monkeypatch):
    monkeypatch.setenv("SCD_CONSUMER_MAX_NEW_TOKENS", "7")  # configuration through the environment
    with services.running(["--model", "tiny-llama", "--log-level", "INFO"], ["--model", "tiny-llama", "--log-level", "INFO"],
                          log_dir=tmp_path) as (producer, consumer):

        async def ask():
            async with ConsumerClient(consumer.address) as client:
                limits = (await client.describe()).limits
                answer = await client.generate(request_id="req-42", context=prompt("alpha beta gamma " * 30),
                                               question=prompt(" delta"), max_new_tokens=3, mode="raw")
                return limits, answer

        limits, answer = asyncio.run(ask())
        assert limits.max_new_tokens == 7
        assert answer.stats.request_id == "req-42"
    assert producer.process.returncode == 0 and consumer.process.returncode == 0
    for service, event in ((producer, "prefill.done"), (consumer, "generate.done")):
        lines = [json.loads(line) for line in service.log_path.read_text().splitlines() if line.startswith("{")]
        tagged = [line for line in lines if line.get("request_id") == "req-42"]
        assert any(line["event"] == event for line in tagged), service.name
        assert all(line["service"] == service.name for line in lines)
        assert any(line["event"] == "server.drained" for line in lines)
