"""Stop strings, matched on detokenized text (the engine only knows stop token ids).

While streaming, text that could be the start of a stop string is held back: with stop "\\nUser:" and output
"...done.\\nUs", the "\\nUs" waits until the next delta shows whether it completes the stop. Because everything
emitted is free of such a prefix, a match can only start inside the held-back text, so only that is searched.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stop = tuple(s for s in stop if s)
        self._include = include_stop_str_in_output
        self._pending = ""          # received but not yet emitted
        self.stopped = False
        self.matched: str | None = None   # the stop string that ended the text

    def feed(self, delta: str) -> str:
        """Adds new text; returns what is safe to emit now. Sets `stopped` on a match (then emits the rest)."""
        if self.stopped or not delta:
            return ""
        if not self._stop:
            return delta
        text = self._pending + delta
        match = self._earliest_match(text)
        if match is not None:
            pos, stop = match
            self.stopped, self.matched, self._pending = True, stop, ""
            return text[:pos + len(stop)] if self._include else text[:pos]
        hold = held_suffix_len(text, self._stop)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The held-back text, once the generation has ended without a match."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            pos = text.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best


def held_suffix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops`: text that must wait for
    the next delta (it may turn out to start a stop string, or a tool-call tag)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
