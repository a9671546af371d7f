"""shared.outcomes: how a call ends is counted once, and a caller that cancels after the call's last
message was handed over to be sent (it read the GenerateStats or the trailer, then cancelled before
the OK status) is counted completed, as the rest of the service counts it."""

from __future__ import annotations

import contextlib

from shared import logs
from shared.outcomes import Outcomes


class _Context:
    def cancelled(self) -> bool:
        return True  # the caller went away


async def _messages(ended: list[bool]):
    yield "token"
    ended.append(True)  # the last message: the stats / the trailer
    yield "stats"


async def _cancel_after(n: int, final) -> Outcomes:
    outcomes, ended = Outcomes(), []
    tracked = outcomes.track(_messages(ended), _Context(), logs.get("test"), "generate", (lambda: bool(ended)) if final else None)
    async with contextlib.aclosing(tracked) as items:
        for _ in range(n):
            await anext(items)
    return outcomes


async def test_a_cancel_after_the_last_message_counts_completed_and_before_it_cancelled():
    after = await _cancel_after(2, final=True)
    assert (after.started, after.completed, after.cancelled, after.failed) == (1, 1, 0, 0)
    before = await _cancel_after(1, final=True)
    assert (before.completed, before.cancelled) == (0, 1)
    untold = await _cancel_after(2, final=False)  # without `final` the wrapper cannot know: cancelled
    assert (untold.completed, untold.cancelled) == (0, 1)
