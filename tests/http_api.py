"""A client of the consumer's OpenAI-compatible HTTP port for tests (aiohttp): the URL of a route
on a running pair, a POST's status and JSON, a stream's events, and what OpenAI's error JSON is."""

from __future__ import annotations

import json

import aiohttp

from tests.conftest import Pair

OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


def url(pair: Pair, path: str) -> str:
    return f"http://127.0.0.1:{pair.consumer.http_port}{path}"


async def post(pair: Pair, path: str, body, **kw) -> tuple[int, dict]:
    """(status, JSON) of a POST; `body` a dict (sent as JSON) or the raw text or bytes."""
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, str | bytes) else json.dumps(body)
        async with session.post(url(pair, path), data=data, headers={"Content-Type": "application/json"}, **kw) as r:
            return r.status, await r.json()


async def stream(pair: Pair, path: str, body: dict) -> list:
    """The SSE events' JSON of `body` streamed, and "[DONE]" for the end marker."""
    events: list = []
    async with aiohttp.ClientSession() as session:
        async with session.post(url(pair, path), json={**body, "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream"), await r.text()
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def is_openai_error(body: dict) -> bool:
    return set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR_KEYS and isinstance(body["error"]["message"], str)
