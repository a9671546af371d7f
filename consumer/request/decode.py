"""The decode loop every answer streams through: an engine task's sampled tokens as the answer's
token deltas (TokenOut, with their log-probabilities when asked), cut where the tokens end it
(consumer.request.ending: a stop id, max_new_tokens, a stop string), counted into the request's stats. The pipeline's answer (consumer.pipeline.pipeline) and
verified decoding's continuation on the exact cache (consumer.exact.verify) are this loop. Knows nothing
about gRPC or codecs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, Callable

from consumer.engine.batch import BatchEngine, Finished, Task
from consumer.engine.decoding import TokenLogprobs
from consumer.engine.process import EngineProcess
from consumer.request.ending import Ending
from consumer.request.engine_stream import engine_task
from consumer.request.job import GenerateJob, GenerateResult, TokenOut


async def decode(
    engine: BatchEngine | EngineProcess,
    job: GenerateJob,
    result: GenerateResult,
    task: Task,
    ending: Ending,
    first: Callable[[float], None] = lambda at: None,
) -> AsyncGenerator[TokenOut, None]:
    """Run `task` (a sampling task) and stream what `ending` keeps of its tokens, then the text
    it held back; `result.generated_tokens` counts them and `result.finish_reason` says why the
    answer ended. `first(perf_counter time)` when the answer's first token arrives (none came
    before: `result.generated_tokens` was 0). Stops reading once the answer ended (the task leaves
    the engine at its next iteration, if it had not finished)."""
    async with contextlib.aclosing(engine_task(engine, job, task, job.stream_interval)) as events:
        async for items in events:
            received = [item for item in items if not isinstance(item, Finished)]
            ids, text = ending.take(received)
            if ids:
                if result.generated_tokens == 0:
                    first(time.perf_counter())
                result.generated_tokens += len(ids)
                yield TokenOut(
                    ids, text, logprobs(job, task, received)[: len(ids)] if job.sampling.logprobs is not None else None
                )
            if ending.reason or isinstance(items[-1], Finished):
                break
    rest = ending.flush()
    if rest:
        yield TokenOut([], rest)
    result.finish_reason = ending.reason or "length"


def logprobs(job: GenerateJob, task: Task, received: list[int]) -> list[TokenLogprobs]:
    """The received ids' log-probabilities, which the engine put in the sampler's `kept` before
    sending each id (the request asked for them: job.sampling.logprobs)."""
    assert task.sampler is not None
    return [task.sampler.kept.popleft() for _ in received]
