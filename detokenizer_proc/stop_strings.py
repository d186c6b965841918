"""Stop strings over streamed text.

Text arrives in pieces (one per step). A stop string may span several pieces, so the matcher
keeps back the longest tail of the text that could still become the start of a stop string:
no emitted piece ever contains a partial stop string, and a match is always found, because a
match can only start inside the kept-back tail (anything earlier was emitted only once it
could no longer begin one).
"""

from __future__ import annotations


class StopStringMatcher:
    """The stop-string state of one request."""

    __slots__ = ("stops", "include_stop", "_pending", "_max_stop_len")

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        # Empty stop strings are refused by the frontend; one here would match everything.
        self.stops = [stop for stop in stops if stop]
        self.include_stop = include_stop
        self._pending = ""
        self._max_stop_len = max((len(stop) for stop in self.stops), default=0)

    @property
    def pending(self) -> str:
        """Text received but not emitted yet (a possible start of a stop string)."""
        return self._pending

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add text; return ``(text to emit, matched stop string or None)``.

        After a match the request is over: the emitted text ends before the stop string (or
        with it, if ``include_stop``), and everything after it is dropped. ``check=False``
        emits without looking for stop strings (while ``min_tokens`` is not reached yet).
        """
        buffer = self._pending + text
        self._pending = ""
        if not self.stops or not check:
            return buffer, None
        match_at, matched = -1, None
        for stop in self.stops:
            at = buffer.find(stop)
            # The earliest match wins; at the same place, the longest stop string.
            if at >= 0 and (
                match_at < 0 or at < match_at or (at == match_at and len(stop) > len(matched))
            ):
                match_at, matched = at, stop
        if matched is not None:
            end = match_at + len(matched) if self.include_stop else match_at
            return buffer[:end], matched
        keep = self._partial_tail(buffer)
        if keep:
            self._pending = buffer[-keep:]
            return buffer[:-keep], None
        return buffer, None

    def flush(self) -> str:
        """The kept-back text, as the request ends without a match."""
        text, self._pending = self._pending, ""
        return text

    def _partial_tail(self, buffer: str) -> int:
        """Length of the longest tail of ``buffer`` that is a proper prefix of a stop string."""
        longest = min(len(buffer), self._max_stop_len - 1)
        for length in range(longest, 0, -1):
            tail = buffer[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
