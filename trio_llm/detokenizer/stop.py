"""Stop strings (OpenAI ``stop``) applied to a stream of text deltas.

Generation stops at the first place where the text ends with one of the stop strings.
The text before that occurrence is returned to the client; the stop string itself is
left out unless ``include_stop_str_in_output`` is set. Streaming makes this subtle: a
stop string can arrive split over several deltas, so text that could still turn into a
stop string is held back until it either completes one (generation stops, the held
text is never sent) or can no longer do so (it is released).

Precisely, for the full text ``T`` the result is defined by the smallest end index
``e`` such that ``T[:e]`` ends with some stop string ``s`` (if several do, the longest
one, i.e. the occurrence starting earliest): the output is ``T[: e - len(s)]`` (plus
``s`` when it is included) and ``s`` is the stop string that matched. Without such an
``e`` the output is ``T`` itself. :class:`StopMatcher` gives exactly this result for any
split of ``T`` into deltas.

Only the held-back text plus the new delta is searched on each step, so the cost per
delta does not grow with the length of the generation. All lengths are in Unicode code
points (Python ``str`` indices).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the first stop string in streamed text and holds back possible prefixes.

    Args:
        stop: the stop strings. Empty strings are ignored and duplicates are harmless;
            with no (non-empty) stop strings every delta is released as is.
        include_stop_str_in_output: release the matched stop string too, instead of
            cutting the text just before it.

    Attributes:
        stop_string: the stop string that matched, or ``None`` while none has. Once it
            is set, :meth:`feed` releases nothing more.
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        # dict.fromkeys dedupes while keeping the caller's order (only for readable reprs).
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stop if s))
        self._include = include_stop_str_in_output
        self._held = ""
        self.stop_string: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The distinct non-empty stop strings, in the order given."""
        return self._stops

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched (generation should end)."""
        return self.stop_string is not None

    @property
    def held_text(self) -> str:
        """Text received but not yet released because it may begin a stop string.

        Always shorter than the longest stop string. Empty after a match or after a
        ``finished`` feed. Meant for debugging and logging.
        """
        return self._held

    def feed(self, text: str, *, finished: bool = False, stop_allowed: bool = True) -> str:
        """Append a text delta and return the text that is now safe to release.

        Args:
            text: the next piece of generated text (may be empty).
            finished: generation ended for another reason (EOS, length limit); text
                that was held back because it might begin a stop string is released.
                A stop string completed by ``text`` still takes precedence.
            stop_allowed: False while generation may not stop yet (vLLM's
                ``min_tokens``): complete stop strings are released as text, but a
                possible beginning of one is still held, so a stop string that starts
                now and ends once stopping is allowed is found.

        Returns:
            The text to pass on (possibly empty). After a match (``stopped`` is true)
            this is the text up to the stop string (including it if configured), and
            every later call returns ``""``.
        """
        if self.stop_string is not None:
            return ""
        if not self._stops:
            return text
        buffer = self._held + text
        match = self._first_match(buffer) if stop_allowed else None
        if match is not None:
            start, stop = match
            self.stop_string = stop
            self._held = ""
            return buffer[: start + len(stop)] if self._include else buffer[:start]
        if finished:
            self._held = ""
            return buffer
        keep_from = self._hold_start(buffer)
        self._held = buffer[keep_from:]
        return buffer[:keep_from]

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """The occurrence in ``buffer`` that ends first (then starts first), if any.

        Returns ``(start index, stop string)``. ``buffer`` is the held text plus the new
        delta; the held text alone never contains a whole stop string (it would have
        matched on the previous call), and any occurrence overlapping already released
        text would have made that text be held, so searching ``buffer`` suffices.
        """
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        return best[1], best[2]

    def _hold_start(self, buffer: str) -> int:
        """Start index of the longest suffix of ``buffer`` that is a proper prefix of a stop.

        Returns ``len(buffer)`` when no suffix qualifies (nothing needs holding back).
        """
        keep_from = len(buffer)
        for stop in self._stops:
            # Only suffixes shorter than the stop string itself and longer than the best
            # so far are worth checking; they must begin with the stop's first character.
            lowest = max(0, len(buffer) - len(stop) + 1)
            first = stop[0]
            index = buffer.find(first, lowest, keep_from)
            while index >= 0:
                if stop.startswith(buffer[index:]):
                    keep_from = index
                    break
                index = buffer.find(first, index + 1, keep_from)
        return keep_from
