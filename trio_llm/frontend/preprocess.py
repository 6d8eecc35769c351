"""From a prompt to engine requests: the one layer every front end shares.

The HTTP routes, the WebSocket and the Python API (`trio_llm.async_engine`) all turn a
prompt (a text, chat messages or token ids) and a `SamplingParams` into engine requests
the same way, here:

- `InputPreprocessor.prepare_chat` is the chat path's one call into this layer: a chat
  request's prompt and what it asks of its choices (`ChatChoices`) in, each choice's
  ``(token_ids, params)`` out (`PreparedChat`).
- `InputPreprocessor.completion_prompts` and `chat_prompt` take a request's whole prompt
  (a completion's ``prompt`` field; a chat's `ChatPrompt`) and give its tokenized,
  checked prompts (`Prompt`), rendering and tokenizing long ones in a worker thread so
  the event loop stays free; `count_chat_tokens` counts a chat prompt's tokens.
- `InputPreprocessor.encode` / `encode_async` tokenize a text, refusing at once one that
  surely cannot fit the context (no tokenization needed); ``encode_async`` runs long
  texts in a worker thread.
- `InputPreprocessor.chat_text` / `chat_text_async` render chat messages with the
  model's chat template.
- `InputPreprocessor.check_token_ids` checks a token-id prompt against the vocabulary.
- `InputPreprocessor.output_budget` fits the output budget into the context.
- `fan_out` makes the ``n`` samples of one request (seeds ``seed + i``).

Every refusal is an `InvalidRequest` naming the parameter at fault: the HTTP layer answers
it with a 400, the Python API raises it (it is a `ValueError`).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import trio

from trio_llm.config import MAX_TOKENS_POLICIES
from trio_llm.errors import (
    ChatTemplateError,
    ContextLengthError,
    InvalidRequest,
    InvalidTextError,
)
from trio_llm.frontend.chat_prompt import (
    ChatChoices,
    ChatPrompt,
    OutputBudget,
    PreparedChat,
    Prompt,
    fold_system_messages,
)
from trio_llm.messages import SamplingParams
from trio_llm.text.template_guard import TemplateLimits
from trio_llm.text.tokenizer import Tokenizer

#: Texts shorter than this (characters) are tokenized or rendered on the event loop
#: (well under 1 ms); longer ones in a worker thread.
INLINE_ENCODE_CHARS = 8192

#: A completion request's ``prompt``: a text, token ids, or a batch of either.
CompletionPrompt = str | list[int] | list[str] | list[list[int]]


class InputPreprocessor:
    """Checks and tokenizes prompts for one model.

    Args:
        tokenizer: the model's tokenizer (with chat template).
        max_model_len: context length in tokens (prompt + output).
        vocab_size: number of token ids (valid ids are ``0 .. vocab_size - 1``).
        max_tokens_policy: what `output_budget` does with a ``max_tokens`` past the
            room the prompt leaves: ``"clamp"`` it to that room, or refuse it
            (``"strict"``, vLLM's 400); `MAX_TOKENS_POLICIES`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        vocab_size: int,
        *,
        max_tokens_policy: str = "clamp",
    ) -> None:
        if max_tokens_policy not in MAX_TOKENS_POLICIES:
            raise ValueError(f"max_tokens_policy must be one of {MAX_TOKENS_POLICIES}")
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_tokens_policy = max_tokens_policy

    # ------------------------------------------------------------ text

    def encode(
        self, text: str, param: str, *, special_tokens: bool, what: str | None = None
    ) -> list[int]:
        """Token ids of ``text`` (a non-empty list).

        Args:
            param: the request field the text came from (named by errors).
            special_tokens: add the tokenizer's own special tokens (e.g. BOS).
            what: how errors call the text (default: ``param``).

        Raises:
            InvalidRequest: text far longer than the context, text that cannot be
                tokenized (a lone surrogate), or text with no tokens.
        """
        self._check_chars(text, param, what)
        return self._non_empty(self._tokenize(text, param, special_tokens), param, what)

    async def encode_async(
        self, text: str, param: str, *, special_tokens: bool, what: str | None = None
    ) -> list[int]:
        """`encode`, in a worker thread when ``text`` is long (the tokenizer releases the
        GIL: other requests keep streaming meanwhile). Raises as `encode`."""
        self._check_chars(text, param, what)
        token_ids = await self.tokenize_async(text, param, special_tokens=special_tokens)
        return self._non_empty(token_ids, param, what)

    async def tokenize_async(self, text: str, param: str, *, special_tokens: bool) -> list[int]:
        """Token ids of ``text`` whatever its length (for ``/tokenize``, which counts
        texts longer than the context), in a worker thread when it is long.

        Raises:
            InvalidRequest: text that cannot be tokenized (a lone surrogate).
        """
        if len(text) < INLINE_ENCODE_CHARS:
            return self._tokenize(text, param, special_tokens)
        return await trio.to_thread.run_sync(self._tokenize, text, param, special_tokens)

    def _tokenize(self, text: str, param: str, special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=special_tokens)
        except InvalidTextError as exc:
            raise InvalidRequest(str(exc), param) from exc

    def _check_chars(self, text: str, param: str, what: str | None) -> None:
        if self.tokenizer.surely_longer_than(text, self.max_model_len):
            # No token has more characters than this: the text has at least so many.
            least = -(-len(text) // self.tokenizer.max_token_chars)
            raise ContextLengthError(
                self.max_model_len,
                least,
                param,
                num_chars=len(text),
                prompt_name=what or param,
            )

    @staticmethod
    def _non_empty(token_ids: list[int], param: str, what: str | None) -> list[int]:
        if not token_ids:
            raise InvalidRequest(f"the {what or param} has no tokens", param)
        return token_ids

    def chat_text(
        self,
        messages: list[dict[str, Any]],
        param: str = "messages",
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        fold_late_system: bool = False,
    ) -> str:
        """The prompt text of chat ``messages`` and ``tools`` (the model's chat template;
        with the assistant's prompt unless ``add_generation_prompt`` is False; with
        ``continue_final_message``, the last assistant message left open; with
        ``template_kwargs``, further template variables: see `Tokenizer.render_chat`).
        With ``fold_late_system``, system messages after the
        first message are folded into the leading system prompt (`fold_system_messages`)
        when the template cannot show them at their place
        (`Tokenizer.renders_late_system`).

        Raises:
            InvalidRequest: the template rejects the messages, or the model has none.
        """
        chat = ChatPrompt(
            messages,
            tools,
            continue_final_message=continue_final_message,
            template_kwargs=template_kwargs,
            fold_late_system=fold_late_system,
            add_generation_prompt=add_generation_prompt,
        )
        return self._render(chat, param)

    async def chat_text_async(self, chat: ChatPrompt, param: str = "messages") -> str:
        """The prompt text of ``chat`` (as `chat_text`), in a worker thread when the
        conversation is long (the template's cost grows with it). Raises as `chat_text`."""
        if chat.size() < INLINE_ENCODE_CHARS and chat.request_template is None:
            return self._render(chat, param)
        return await trio.to_thread.run_sync(self._render, chat, param)

    def _render(self, chat: ChatPrompt, param: str) -> str:
        messages, own = chat.messages, chat.request_template
        if chat.fold_late_system and own is None:
            if not self.tokenizer.renders_late_system(bool(chat.tools)):
                messages = fold_system_messages(messages)
        # A request's template renders no longer a text than could fit the context.
        max_chars = self.max_model_len * self.tokenizer.max_token_chars
        try:
            return self.tokenizer.render_chat(
                messages,
                add_generation_prompt=chat.add_generation_prompt,
                tools=chat.tools,
                continue_final_message=chat.continue_final_message,
                template_kwargs=chat.template_kwargs,
                request_template=own.source if own else None,
                limits=TemplateLimits(own.timeout, max_chars) if own else None,
            )
        except ChatTemplateError as exc:  # a request's own template: its field named
            raise InvalidRequest(str(exc), "chat_template" if own else param) from exc

    # ------------------------------------------------------------ whole prompts

    async def chat_prompt(self, chat: ChatPrompt, *, count_only: bool = False) -> Prompt:
        """Render and tokenize a chat request's prompt (field ``messages``), off the event
        loop when it is long.

        Args:
            count_only: count it whatever its length (``/v1/messages/count_tokens``):
                no check against the context, none for an empty prompt.

        Returns:
            Its token ids (no special tokens added: the template writes them) and the
            rendered text.

        Raises:
            InvalidRequest: the template rejects the messages; a prompt far longer than
                the context, or with no tokens (unless ``count_only``).
        """
        text = await self.chat_text_async(chat)
        if count_only:
            token_ids = await self.tokenize_async(text, "messages", special_tokens=False)
        else:
            token_ids = await self.encode_async(text, "messages", special_tokens=False)
        return Prompt(token_ids, text)

    async def prepare_chat(self, chat: ChatPrompt, choices: ChatChoices) -> PreparedChat:
        """A chat request's engine requests: its stop token ids checked, its prompt
        rendered and tokenized (`chat_prompt`), its output budget fitted into the context
        (`output_budget`; with ``choices.count_only`` none: the prompt is only counted),
        and ``choices.n`` samples of ``choices.sampling(max_tokens)`` (`fan_out`).

        Raises:
            InvalidRequest: a stop token id outside the vocabulary; as `chat_prompt`.
            ContextLengthError: as `output_budget`.
            APIError: what ``choices.sampling`` raises (a field the budget contradicts).
        """
        if choices.stop_token_ids:
            self.check_token_ids(choices.stop_token_ids, "stop_token_ids")
        prompt = await self.chat_prompt(chat, count_only=choices.count_only)
        budget = OutputBudget(1, "request")  # counted only: no check against the context
        if not choices.count_only:
            budget = self.output_budget(
                choices.max_tokens,
                len(prompt.token_ids),
                choices.max_tokens_param,
                "messages",
                default=choices.default_max_tokens,
                cap=choices.max_tokens_cap,
            )
        params = fan_out(choices.sampling(budget.tokens), choices.n)
        return PreparedChat(prompt, budget, [(prompt.token_ids, p) for p in params])

    def count_chat_tokens(self, chat: ChatPrompt) -> int:
        """The token count of ``chat``'s prompt, rendered as `chat_prompt` renders it
        (whatever its length: no context check), on the calling thread.

        Raises:
            InvalidRequest: the chat template rejects the messages.
        """
        text = self._render(chat, "messages")
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    async def completion_prompts(self, prompt: CompletionPrompt) -> list[Prompt]:
        """The prompts of a completion request's ``prompt`` field: a text, token ids, or
        a list of either (a batch); each text tokenized with the tokenizer's special
        tokens (off the event loop when long), each token-id prompt checked.

        Returns:
            One `Prompt` per prompt, in order, each with its text as given (None for
            token ids).

        Raises:
            InvalidRequest: an empty prompt, a text far longer than the context or with
                no tokens, a token id outside the vocabulary.
            TypeError: a token id that is not an integer.
        """
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            items: list[str | list[int]] = [prompt]  # type: ignore[list-item]
        else:
            items = list(prompt)  # type: ignore[arg-type]
        prompts = []
        for item in items:
            if not item:
                raise InvalidRequest("the prompt is empty", "prompt")
            if isinstance(item, str):
                ids = await self.encode_async(item, "prompt", special_tokens=True)
                prompts.append(Prompt(ids, item))
            else:
                prompts.append(Prompt(self.check_token_ids(item, "prompt")))
        return prompts

    # ------------------------------------------------------------ token ids

    def check_token_ids(self, token_ids: Iterable[Any], param: str = "prompt") -> list[int]:
        """``token_ids`` as a list of ints, each in the vocabulary.

        Raises:
            TypeError: an item that is not an integer (bool included).
            InvalidRequest: an id outside ``0 .. vocab_size - 1``.
        """
        checked = []
        for item in token_ids:
            if isinstance(item, bool):
                raise TypeError("token ids must be integers, not bool")
            try:
                checked.append(operator.index(item))
            except TypeError:
                raise TypeError(
                    "a prompt is a str, a list of chat messages (dicts) or a list of token "
                    f"ids; it holds a {type(item).__name__}"
                ) from None
        bad = next((t for t in checked if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is out of range for a vocabulary of {self.vocab_size}", param
            )
        return checked

    # ------------------------------------------------------------ output budget

    def output_budget(
        self,
        requested: int | None,
        num_prompt: int,
        param: str = "max_tokens",
        prompt_param: str = "prompt",
        *,
        default: int | None = None,
        cap: int | None = None,
    ) -> OutputBudget:
        """The output budget (tokens) within the context, and the limit that set it.

        Args:
            requested: the request's ``max_tokens``; None means ``default``, or else the
                rest of the context.
            num_prompt: the prompt's length in tokens.
            param, prompt_param: the fields errors name.
            default: the server's ``max_tokens`` for requests that give none
                (``max_new_tokens`` of the generation config), or None.
            cap: a server-side limit on every request's output (``max_new_tokens`` of
                ``--override-generation-config``), or None.

        Returns:
            Its ``tokens``: ``requested`` (else ``default``, else the room left), lowered
            to the room the context leaves after the prompt and to ``cap``. With the
            policy ``"clamp"`` a larger ``requested`` is thus lowered to the room left
            (llama.cpp's and Ollama's behaviour): the output then ends with finish_reason
            "length" when it fills the context. Its ``bound``: which of them set it.

        Raises:
            ContextLengthError: the prompt leaves no room for output; with the policy
                ``"strict"`` (vLLM's), also a ``requested`` above the room left.
        """
        if num_prompt >= self.max_model_len:
            raise ContextLengthError(
                self.max_model_len, num_prompt, prompt_param, prompt_name=prompt_param
            )
        room = self.max_model_len - num_prompt
        if requested is not None and requested > room and self.max_tokens_policy == "strict":
            raise ContextLengthError(
                self.max_model_len,
                num_prompt,
                param,
                max_tokens=requested,
                prompt_name=prompt_param,
            )
        wanted = requested if requested is not None else default
        tokens = min([room, *(v for v in (wanted, cap) if v is not None)])
        if tokens == room:
            return OutputBudget(tokens, "context")
        return OutputBudget(tokens, "request" if tokens == requested else "server")


def child_seed(seed: int | None, index: int) -> int | None:
    """Seed of the ``index``-th of ``n`` samples: ``seed + index``, wrapped to int64."""
    if seed is None:
        return None
    return (seed + index + 2**63) % 2**64 - 2**63


def fan_out(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The ``n`` samples of one request: copies of ``params`` with seeds ``seed + i``
    (``params`` itself when ``n`` is 1)."""
    if n == 1:
        return [params]
    fields = {name: getattr(params, name) for name in params.__struct_fields__}
    return [SamplingParams(**{**fields, "seed": child_seed(params.seed, i)}) for i in range(n)]
