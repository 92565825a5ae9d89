"""Stop strings on streamed text: the text released to the caller never contains a stop string,
and never shows the start of one that the next token could complete.

OpenAI semantics: the output ends just before the first stop string, which is not included. The
detokenizer's deltas go in (``add``); what comes out is safe to send. While the text ends in a
prefix of some stop string ("\\n" with stop "\\n\\n", "Obs" with "Observation:") that suffix is
held back until the next delta settles it: the stop completes (the held text is dropped) or it
does not (the held text is released). When the request ends for another reason (EOS, max_tokens)
``flush`` releases what is held. So the streamed deltas always add up to the final text.
"""

from __future__ import annotations


class StopStrings:
    """One request's stop-string state; the scheduler's thread feeds it the detokenizer's
    deltas in order."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self.text = ""  # all the text so far, released and held; cut at a stop once stopped
        self.num_released = 0  # text[:num_released] has been released
        self.stopped = False

    def add(self, delta: str) -> str:
        """Take the next delta; return the text that may now be released."""
        assert not self.stopped, "text added after the stop"
        # A stop cannot start in released text: that text had no suffix that begins a stop.
        start = self.num_released
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held(start))

    def flush(self) -> str:
        """The request ended for another reason: release what is held."""
        return self._release(len(self.text))

    def _held(self, start: int) -> int:
        """The length of the longest suffix of text[start:] that is a proper prefix of a stop."""
        tail = self.text[start:]
        for n in range(min(len(tail), max(map(len, self.stops)) - 1), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self.stops):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self.text[self.num_released : end]
        self.num_released = max(self.num_released, end)
        return out
