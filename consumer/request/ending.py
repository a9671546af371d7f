"""Where an answer ends, read from its tokens alone: at the first stop id (kept), at
max_new_tokens, or at the first token whose text completes a stop string (kept; the text ends
before the string). Never from when an engine message arrives: the decode loop
(consumer.request.decode) and verified decoding's drafts and verified tokens (consumer.exact.verify) are cut by
it, whatever order the engine's token and Finished posts reach the event loop in.

Also the answer's text: deltas of the tokens it keeps (consumer.engine.decoding.Detokenizer), holding
back a tail that may begin a stop string (consumer.engine.decoding.StopText). Pure: ids and a tokenizer.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from consumer.engine.decoding import Detokenizer, StopText
from consumer.request.job import GenerateJob


class Ending:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        max_new: int,
        stop_ids: frozenset[int],
        stop_strings: tuple[str, ...] = (),
    ):
        self.detok = Detokenizer(tokenizer)
        self.max_new, self.stop_ids = max_new, stop_ids
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.stop = StopText(self.stop_strings)  # the text shown, a tail that may begin a stop string held back
        self.count = 0  # tokens the answer has kept
        self.reason = ""  # "stop" | "length" once it ended

    def take(self, ids: list[int]) -> tuple[list[int], str]:
        """The ids that follow the answer so far -> (those it keeps: up to the one that ends it,
        included; the text that may be shown now). Nothing once it ended."""
        if self.reason:
            return [], ""
        kept = ids
        for i, token in enumerate(ids):
            if token in self.stop_ids or self.count + i + 1 >= self.max_new:
                kept = ids[: i + 1]
                break
        if self.stop_strings:
            kept, text = self._strings(kept)
        else:
            text = self.detok.push_many(kept)
        self.count += len(kept)
        if not self.reason and kept and (kept[-1] in self.stop_ids or self.count >= self.max_new):
            self.reason = "stop" if kept[-1] in self.stop_ids else "length"
        return kept, text

    def _strings(self, ids: list[int]) -> tuple[list[int], str]:
        """Token by token: the first whose text completes a stop string ends the answer."""
        shown = []
        for i, token in enumerate(ids):
            shown.append(self.stop.push(self.detok.push(token)))
            if self.stop.hit:
                self.reason = "stop"
                return ids[: i + 1], "".join(shown)
        return ids, "".join(shown)

    def flush(self) -> str:
        """Text still held back once the answer ended (a partial stop string that stayed one, an
        incomplete byte sequence); nothing after a stop string."""
        if not self.stop_strings:
            return self.detok.flush()
        rest = self.stop.push(self.detok.flush())
        return rest if self.stop.hit else rest + self.stop.flush()


def ending_of(tokenizer: PreTrainedTokenizerBase, job: GenerateJob) -> Ending:
    """The ending a request asked for: its max_new_tokens, stop ids and stop strings."""
    return Ending(tokenizer, job.max_new_tokens, job.stop_ids, job.stop_strings)
