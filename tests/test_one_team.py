"""One OpenMP team per process (shared.torch_threads): a pinned thread keeps its count whatever the
process-wide count becomes, pinning leaves the count of threads yet to compute alone, and in a
running consumer the engine's OpenMP worker spins between parallel regions instead of sleeping
(libgomp stops spinning once a process holds more OpenMP threads than CPUs: the main thread's team
from loading the model beside the engine's made it sleep and wake ~270 times a decode step); in a
running producer the forward's worker does the same over a cold prefill (the encode thread beside
the forward computed with a team of its own)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from bench.harness import services
from consumer.api.client import ConsumerClient, prompt
from shared import torch_threads


def test_on_new_thread_returns_the_result_and_raises_the_error_on_the_caller():
    assert torch_threads.on_new_thread(lambda a, b: a + b, 2, 3) == 5
    names = []
    torch_threads.on_new_thread(lambda: names.append(threading.current_thread().name), name="scd-test")
    assert names == ["scd-test"]
    with pytest.raises(KeyError, match="boom"):
        torch_threads.on_new_thread(lambda: {}["boom"])


def test_a_pinned_thread_keeps_its_count_and_others_keep_the_process_count():
    before = torch_threads.on_new_thread(torch.get_num_threads)
    seen: dict[str, int] = {}
    pinned, changed = threading.Event(), threading.Event()

    def worker() -> None:
        torch_threads.pin(3)
        seen["pinned"] = torch.get_num_threads()
        pinned.set()
        changed.wait(30)
        torch.zeros(4 * torch_threads.GRAIN).add_(1)
        seen["after the process count changed"] = torch.get_num_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert pinned.wait(30)
        seen["a new thread after the pin"] = torch_threads.on_new_thread(torch.get_num_threads)
        main = torch.get_num_threads()
        torch.set_num_threads(1)  # the process-wide count changes (this thread's too)
        changed.set()
        thread.join(30)
    finally:
        changed.set()
        torch.set_num_threads(main)
    assert seen == {"pinned": 3, "a new thread after the pin": before, "after the process count changed": 3}


def _voluntary_switches(pid: int, name: str) -> int:
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/status") as f:
                fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except FileNotFoundError:  # a thread that ended
            continue
        if fields["Name"].strip() == name:
            total += int(fields["voluntary_ctxt_switches"])
    return total


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: teams of one thread, nothing to spin")
@pytest.mark.parametrize("where", [[], ["--engine-process"]], ids=["engine-thread", "engine-process"])
def test_the_consumer_engine_workers_spin_between_regions(tmp_path, where):
    """A real consumer at as many torch threads as cores: over a generation its engine's threads
    (the engine thread and its OpenMP workers, which take its name; in the engine process under
    --engine-process) go to sleep a few times per token at most (a GIL wait, the gap between two
    steps), not once per parallel region."""
    threads = str(min(os.cpu_count() or 2, 4))
    flags = ["--model", "smollm2-135m", "--dtype", "bfloat16", "--torch-threads", threads]
    with services.running(flags, [*flags, "--probe-idle-s", "0", *where], log_dir=tmp_path) as (_, consumer):
        pids = [consumer.process.pid, *services.children(consumer.process.pid)]

        async def ask(tokens: int) -> int:
            async with ConsumerClient(consumer.address) as client:
                answer = await client.generate(mode="oracle", context=prompt("The river runs north. " * 40),
                                               question=prompt(" Where does it run?"), max_new_tokens=tokens,
                                               stop_token_ids=[49151])  # a stop it never meets: `tokens` steps  # fmt: skip
                return len(answer.ids)

        asyncio.run(ask(4))  # the engine's first requests after warm-up: the team formed
        before = sum(_voluntary_switches(pid, "consumer-engine") for pid in pids)
        made = asyncio.run(ask(48))
        slept = sum(_voluntary_switches(pid, "consumer-engine") for pid in pids) - before
    assert made == 48
    # ~30 layers x ~9 parallel regions per decode step: a worker that slept after each would
    # switch hundreds of times per token
    assert slept / made < 30, f"the engine's threads slept {slept} times over {made} tokens"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: teams of one thread, nothing to spin")
def test_the_producer_forward_workers_spin_between_regions(tmp_path):
    """A real producer at as many torch threads as cores: over cold prefills its forward's threads
    (the compute thread and its OpenMP workers, which take its OS name) go to sleep a few times per
    layer at most, not once per parallel region: the encode threads beside the forward, the disk
    writer and the event loop's default pool compute on one thread each and form no team."""
    threads = str(min(os.cpu_count() or 2, 4))
    flags = ["--model", "smollm2-135m", "--dtype", "bfloat16", "--torch-threads", threads]
    consumer_flags = [*flags, "--probe-idle-s", "0", *services.NO_PREFIX_CACHE]
    with services.running(flags, consumer_flags, log_dir=tmp_path) as (producer, consumer):

        async def ask(serial: int) -> int:
            async with ConsumerClient(consumer.address) as client:
                context = prompt(f"Log {serial}: " + " ".join(f"entry {serial}-{i} ok;" for i in range(120)))
                answer = await client.generate(mode="raw", context=context, question=prompt(" Which?"), max_new_tokens=1)
                return len(answer.ids)

        asyncio.run(ask(0))  # the producer's first cold prefill after warm-up: the team formed
        before = _voluntary_switches(producer.process.pid, "producer-fwd")
        made = sum(asyncio.run(ask(serial)) for serial in range(1, 4))
        slept = _voluntary_switches(producer.process.pid, "producer-fwd") - before
    assert made == 3
    layers = 30
    # a worker that slept after each parallel region switched ~75 times per layer (6,700 over these 3
    # prefills, the encode thread's team beside the compute thread's); with one team ~3.6 a layer
    assert slept / (3 * layers) < 20, f"the producer's forward threads slept {slept} times over 3 prefills"
