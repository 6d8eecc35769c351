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

The stop strings are compiled once into an Aho–Corasick automaton (cached by the tuple of
strings, so the ``n`` choices of one request share it). Feeding text advances the automaton
one character at a time and never looks back, so a delta costs O(len(delta)) amortized,
whatever the number and length of the stop strings; building costs O(total characters).
All lengths are in Unicode code points (Python ``str`` indices).

With ``stop_allowed=False`` (vLLM's ``min_tokens``), a stop string that *ends* there is
text like any other; one that begins there and ends once stopping is allowed matches.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence

#: Keys of the goto table: ``node * _KEY_STRIDE + code point`` (one int per edge).
_KEY_STRIDE = 0x110000


class StopAutomaton:
    """Aho–Corasick automaton over a fixed tuple of non-empty stop strings (immutable).

    Node 0 is the root (the empty string); every node is a prefix of some stop string.

    Attributes:
        stops: the stop strings, indexed by the ``match`` table.
        match: per node, the index of the longest stop string that is a suffix of the
            node's string, or -1.
        hold: per node, the length of the longest suffix of the node's string that is a
            *proper* prefix of some stop string (text that must be held back).
    """

    __slots__ = ("_fail", "_goto", "hold", "match", "stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        goto: dict[int, int] = {}
        depth = [0]
        terminal = [-1]
        children: list[list[tuple[int, int]]] = [[]]
        for index, stop in enumerate(stops):
            node = 0
            for char in stop:
                code = ord(char)
                child = goto.get(node * _KEY_STRIDE + code)
                if child is None:
                    child = len(depth)
                    goto[node * _KEY_STRIDE + code] = child
                    depth.append(depth[node] + 1)
                    terminal.append(-1)
                    children[node].append((code, child))
                    children.append([])
                node = child
            if terminal[node] < 0:
                terminal[node] = index
        size = len(depth)
        self._goto = goto
        self._fail = fail = [0] * size
        self.match = match = [-1] * size
        self.hold = hold = [0] * size
        # Breadth first: a node's failure link is shallower, so it is done before it.
        queue = deque([0])
        while queue:
            node = queue.popleft()
            for code, child in children[node]:
                link = 0 if node == 0 else self._next(fail[node], code)
                fail[child] = link
                match[child] = terminal[child] if terminal[child] >= 0 else match[link]
                hold[child] = depth[child] if children[child] else hold[link]
                queue.append(child)

    def _next(self, node: int, code: int) -> int:
        goto = self._goto
        fail = self._fail
        while True:
            child = goto.get(node * _KEY_STRIDE + code)
            if child is not None:
                return child
            if node == 0:
                return 0
            node = fail[node]

    def step(self, node: int, char: str) -> int:
        """The node after reading ``char`` in ``node`` (amortized O(1) over a text)."""
        return self._next(node, ord(char))


@functools.lru_cache(maxsize=256)
def compile_stops(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of ``stops`` (non-empty, distinct), built once per distinct tuple."""
    return StopAutomaton(stops)


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
        self._automaton = compile_stops(self._stops) if self._stops else None
        self._node = 0
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
        automaton = self._automaton
        if automaton is None:
            return text
        buffer = self._held + text
        base = len(self._held)
        node = self._node
        match = automaton.match
        for offset, char in enumerate(text):
            node = automaton.step(node, char)
            if stop_allowed and match[node] >= 0:
                stop = automaton.stops[match[node]]
                end = base + offset + 1
                self.stop_string = stop
                self._held = ""
                return buffer[:end] if self._include else buffer[: end - len(stop)]
        if finished:
            self._held = ""
            self._node = 0
            return buffer
        self._node = node
        keep_from = len(buffer) - automaton.hold[node]
        self._held = buffer[keep_from:]
        return buffer[:keep_from]
