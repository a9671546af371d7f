"""The producer's compute: run the prefill and hand out each layer's encoded payloads as soon as
that layer is done.

The forward runs on the producer's compute thread; a hook after every decoder layer encodes the
layer and hands it to the request's own buffer (an unbounded asyncio queue), never waiting for
the network: a slow or stalled consumer delays only its own stream, never the forward of any
other request (no head-of-line blocking on the compute thread). A request's buffer holds at
most its own encoded stream, so memory is bounded by what the request itself may cost
(max_context_tokens and its codec) times the admitted requests (max_inflight). Closing the
stream early (caller cancelled, deadline passed, error) stops the forward at the next layer
boundary. Knows nothing about gRPC: the servicer passes a `pack` function that turns payloads
into whatever it sends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from shared import kv, logs
from shared.codecs import LayerEncoder
from shared.models import LoadedModel

log = logs.get("producer.prefill")


@dataclass
class EncodedLayer:
    layer: int
    packed: Any  # what pack(layer, payloads) returned
    payload_bytes: int
    encode_ms: float


@dataclass
class PrefillDone:
    prefill_ms: float  # forward wall time, encode time excluded
    encode_ms: float
    layers: int


class PrefillCancelled(Exception):
    """Raised inside the forward to stop it once the stream is closed."""


@dataclass
class _Failed:
    exc: BaseException


class PrefillEngine:
    def __init__(self, loaded: LoadedModel, executor: concurrent.futures.Executor):
        self.loaded = loaded
        self.executor = executor

    async def stream(
        self,
        token_ids: list[int],
        encoder: LayerEncoder,
        pack: Callable[[int, dict[str, torch.Tensor]], Any],
    ) -> AsyncIterator[EncodedLayer | PrefillDone]:
        """Yields one EncodedLayer per layer in order, then PrefillDone. Use with aclosing()."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()  # this request's buffer; see the module doc for its bound
        closed = threading.Event()
        encode_ms = 0.0

        def emit(item: object) -> None:
            if closed.is_set():
                raise PrefillCancelled()
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def on_layer(state: kv.LayerState) -> None:
            nonlocal encode_ms
            if closed.is_set():
                raise PrefillCancelled()
            started = time.perf_counter()
            payloads = {name: t.detach().to("cpu").contiguous() for name, t in encoder.encode(state).items()}
            packed = pack(state.index, payloads)
            took = (time.perf_counter() - started) * 1e3
            encode_ms += took
            nbytes = sum(t.numel() * t.element_size() for t in payloads.values())
            emit(EncodedLayer(state.index, packed, nbytes, took))

        def work() -> None:
            started = time.perf_counter()
            layers_done = 0

            def counted(state: kv.LayerState) -> None:
                nonlocal layers_done
                on_layer(state)
                layers_done += 1

            try:
                if closed.is_set():  # cancelled while queued behind other prefills
                    raise PrefillCancelled()
                ids = torch.tensor([token_ids], device=self.loaded.device)  # [1, T]
                cache = kv.empty_cache(self.loaded)
                with kv.layer_capture(self.loaded, cache, encoder.captures, counted):
                    kv.prefill_context(self.loaded, ids, cache)
                total_ms = (time.perf_counter() - started) * 1e3
                emit(PrefillDone(prefill_ms=total_ms - encode_ms, encode_ms=encode_ms, layers=layers_done))
            except PrefillCancelled:
                log.info("prefill.stopped", layers_done=layers_done, num_layers=self.loaded.info.num_layers)
            except BaseException as exc:
                if not closed.is_set():
                    loop.call_soon_threadsafe(queue.put_nowait, _Failed(exc))

        forward = asyncio.ensure_future(logs.run_in(self.executor, work))
        try:
            while True:
                item = await queue.get()
                if isinstance(item, _Failed):
                    raise item.exc
                yield item
                if isinstance(item, PrefillDone):
                    return
        finally:
            closed.set()  # a forward still running (or still queued) stops at its next layer
            forward.add_done_callback(lambda f: f.exception() if not f.cancelled() else None)
