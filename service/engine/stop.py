"""Stop strings matched across token (and delta) boundaries, without ever emitting part of a stop."""

from __future__ import annotations


class StopStringMatcher:
    """Filters a request's detokenized text stream against its stop strings.

    Text that could still be the start of a stop string is held back until the next delta settles
    it. When several stops occur, the one that completes first in the text wins (ties: the one that
    starts first, i.e. the longest). That is the stop the engine would see if text arrived one
    character at a time, so the result does not depend on how the text was split into deltas.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stop if s)  # an empty stop would match everywhere: ignore it
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        return self._matched

    def feed(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, the stop string that matched or None). After a match the
        request is over: the stop itself and everything after it are dropped."""
        assert self._matched is None, "feed() after a stop string matched"
        if not self._stops:
            return text, None
        buffer = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)  # the earliest start of one stop is also its earliest end
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is not None:
            _, start, stop = best
            self._held = ""
            self._matched = stop
            return buffer[:start], stop
        hold = self._held_suffix_length(buffer)
        self._held = buffer[len(buffer) - hold:]
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """At finish without a match: the held-back text was never a stop, release it."""
        held, self._held = self._held, ""
        return held

    def _held_suffix_length(self, buffer: str) -> int:
        """The longest suffix of buffer that is a proper prefix of a stop (it must be held back).
        Memory stays proportional to the stops: candidates are the positions of a stop's first character."""
        n, longest = len(buffer), 0
        for stop in self._stops:
            i = buffer.find(stop[0], max(0, n - len(stop) + 1))
            while i != -1 and n - i > longest:
                if stop.startswith(buffer[i:]):
                    longest = n - i
                    break
                i = buffer.find(stop[0], i + 1)
        return longest
