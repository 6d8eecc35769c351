"""Requests waiting for their structured output's grammar (vLLM's ``WAITING_FOR_FSM``).

A structured output's grammar is compiled in a worker thread (`GrammarCompiler`); its
request waits in the scheduler's waiting queue meanwhile, unscheduled and holding no KV
blocks (`trio_llm.engine.request.Request.waits_for_grammar`). `GrammarWaits` keeps those
requests and, once a compile is done (or past its time limit), hands each its own matcher
or its error.
"""

from __future__ import annotations

import logging

from trio_llm.engine.grammar_compiler import GrammarCompile, GrammarCompiler
from trio_llm.engine.request import Request
from trio_llm.structured_output.errors import StructuredOutputError, internal_error_text

logger = logging.getLogger(__name__)


class GrammarWaits:
    """The requests whose grammar is compiling, by id.

    Args:
        grammars: the compiler their grammars are compiled by.
    """

    def __init__(self, grammars: GrammarCompiler) -> None:
        self.grammars = grammars
        self._requests: dict[str, Request] = {}

    def __bool__(self) -> bool:
        """True while any request waits for its grammar."""
        return bool(self._requests)

    def start(self, request: Request) -> str | None:
        """Compile ``request``'s structured output (or share a compile under way or done).

        Returns:
            The request's error text if its grammar is known to have failed (or its
            compile is past its time limit); else None: it has its matcher, or waits here.
        """
        try:
            job = self.grammars.compile(request.params.structured_output)
        except Exception as exc:  # a bug: this request fails, the engine goes on
            logger.exception(f"request {request.request_id}: its grammar failed to start")
            return internal_error_text(exc)
        request.grammar = job
        if job.ready():  # compiled before (or its compile is past its time limit)
            return self._take(request)
        self._requests[request.request_id] = request
        return None

    def any_ready(self) -> bool:
        """True when a compile is done or timed out (`collect` would hand it over)."""
        return any(request.grammar.ready() for request in self._requests.values())

    def collect(self) -> list[tuple[str, str]]:
        """Give the requests whose grammar compiled their matchers (they may be scheduled
        from now on); the ``(request_id, error)`` of those whose grammar failed or timed
        out, which the caller ends."""
        failed = []
        for request_id, request in list(self._requests.items()):
            if not request.grammar.ready():
                continue
            del self._requests[request_id]
            error = self._take(request)
            if error is not None:
                failed.append((request_id, error))
        return failed

    def drop(self, request_id: str) -> None:
        """Stop waiting for ``request_id``'s grammar (unknown ids are ignored): a compile no
        other request waits for is cancelled if no worker began it yet."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.grammars.release(request.grammar)
            request.grammar = None

    def _take(self, request: Request) -> str | None:
        """Give ``request`` its own copy of its compiled grammar (`Request.grammar`, a
        ready `GrammarCompile`); the request's error text if the grammar failed or its
        compile ran past the time limit."""
        job: GrammarCompile = request.grammar
        request.grammar = None
        if not job.done():  # timed out, still running: it stays cached when it ends
            self.grammars.release(job)
            return (
                f"structured_output: the grammar did not compile within "
                f"{self.grammars.timeout:g} s (this server's limit); simplify it"
            )
        job.waiters -= 1
        try:
            request.matcher = job.future.result().deep_copy()
        except StructuredOutputError as exc:
            return f"structured_output: {exc}"
        except Exception as exc:  # a bug: this request fails, the engine goes on
            logger.exception(f"request {request.request_id}: its grammar failed to compile")
            return internal_error_text(exc)
        return None
