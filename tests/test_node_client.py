"""A client in another language: tests/node/scd_client.js (@grpc/grpc-js + @grpc/proto-loader,
protos/ loaded at run time, no generated code) against a real producer/consumer pair calls
Health.Check, ConsumerService.Describe and ConsumerService.Generate (oracle and raw) and gets
the same answers as the Python client. Skipped where `node` or `npm` is missing; `npm ci` runs
once when tests/node/node_modules is absent."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from shared.pb import consumer_pb2
from tests.conftest import prompt, running_pair

NODE_DIR = Path(__file__).resolve().parent / "node"
CONTEXT = "The producer reads a long context and the consumer writes the answer. " * 4
QUESTION = " Who writes the answer?"
MODES = ["oracle", "raw"]

pytestmark = pytest.mark.skipif(
    not (shutil.which("node") and shutil.which("npm")), reason="node and npm are needed for the Node.js client test"
)


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """tests/node/node_modules from the committed package-lock.json (npm ci, once)."""
    installed = NODE_DIR / "node_modules/@grpc/grpc-js/package.json"
    if not installed.exists():
        result = subprocess.run(
            ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, f"npm ci failed:\n{result.stdout}\n{result.stderr}"
    return NODE_DIR / "node_modules"


async def run_node_client(address: str, request: dict) -> dict:
    """The Node client as a subprocess, awaited so the in-process servers keep serving."""
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(NODE_DIR / "scd_client.js"),
        address,
        json.dumps(request),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def test_node_client_gets_the_python_clients_answers(node_modules):
    request = {"context": {"text": CONTEXT}, "question": {"text": QUESTION}, "max_new_tokens": 6}
    async with running_pair("tiny-llama") as pair:
        got = await run_node_client(pair.consumer.address, request)
        described = await pair.client.describe()
        expected = {
            mode: await pair.client.generate(mode=mode, context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=6)
            for mode in MODES
        }

    assert got["health"] == {"(server)": "SERVING", "scd.v1.ConsumerService": "SERVING"}
    assert got["describe"]["api_version"] == described.api_version == "scd.v1"
    assert got["describe"]["model"] == MessageToDict(
        described.model, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    assert got["describe"]["codecs"] == [c.name for c in described.codecs]
    for mode in MODES:
        node, python = got["generate"][mode], expected[mode]
        assert node["ids"] == python.ids and len(node["ids"]) > 0, mode
        assert node["text"] == python.text
        stats = node["stats"]
        # oneofs: true names the member; the stats message is the last one on the stream
        assert node["messages"] >= 2
        assert stats["transfer"]["name"] == mode == python.stats.transfer.name
        assert stats["generated_tokens"] == python.stats.generated_tokens == len(node["ids"])
        # longs: String -> uint64 as decimal strings; enums: String -> names
        assert stats["raw_kv_bytes"] == str(python.stats.raw_kv_bytes) and int(stats["raw_kv_bytes"]) > 0
        assert isinstance(stats["bytes_received"], str)
        assert (int(stats["bytes_received"]) > 0) == (mode == "raw")
        assert stats["finish_reason"].startswith("FINISH_REASON_")


async def test_node_client_applies_a_verify_commit(node_modules):
    """Provisional tokens, then a commit: the Node client's answer is the Python client's."""
    request = {"context": {"text": CONTEXT}, "question": {"text": QUESTION}, "max_new_tokens": 6,
               "verify": "VERIFY_POLICY_PROVISIONAL"}
    async with running_pair("tiny-llama", consumer_kw={"prefill_chunk": 16}) as pair:
        got = await run_node_client(pair.consumer.address, request)
        python = await pair.client.generate(mode="raw", context=prompt(CONTEXT), question=prompt(QUESTION), max_new_tokens=6,
                                            verify=consumer_pb2.VERIFY_POLICY_PROVISIONAL)
    node = got["generate"]["raw"]
    assert node["ids"] == python.ids and node["text"] == python.text and python.commit is not None
    assert node["stats"]["verify_decision"].startswith("verified") and "provisional_ids" in node
    assert got["generate"]["oracle"]["stats"]["verify_decision"] == "skipped: mode oracle is exact"
