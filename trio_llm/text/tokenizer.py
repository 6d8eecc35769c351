"""The API server's tokenizer: prompts and chat messages to token ids.

Loaded from a local model folder with the fast ``tokenizers`` library alone (the
``tokenizer.json`` written by Hugging Face), plus the chat template from
``chat_template.jinja`` or ``tokenizer_config.json``. The API process therefore never
imports torch or transformers, which keeps it small and quick to start.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer

from trio_llm.errors import ChatTemplateError, InvalidTextError
from trio_llm.text.chat_template import (
    TemplateError,
    render_template,
    template_variables,
    tool_template_for,
)
from trio_llm.text.template_guard import DEFAULT_LIMITS, TemplateLimits, render_guarded

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")

#: SentencePiece byte-fallback tokens look like ``<0xE3>``.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of the byte-level BPE alphabet (GPT-2; Radford et al. 2019).

    Byte-level vocabularies spell each byte as one printable character: bytes that are
    printable Latin-1 characters stand for themselves, and the other 68 bytes (controls,
    space, soft hyphen, ...) take the code points from 256 upward, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    extra = 256
    for b in range(256):
        if b not in printable:
            alphabet[chr(extra)] = b
            extra += 1
    return alphabet


class Tokenizer:
    """A model's tokenizer and chat template.

    Attributes:
        backend: the fast ``tokenizers.Tokenizer`` (also used by the detokenizer).
        chat_template: Jinja source of the chat template, or None if the model has none.
        tool_template: the template that shows ``tools`` to the model: the chat template
            itself if it reads them, a shipped tool-aware version of it, or None.
        special_tokens: ``bos_token``, ``eos_token``, ... as strings, for the template.
    """

    def __init__(
        self,
        backend: FastTokenizer,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.tool_template = tool_template_for(chat_template)
        self.special_tokens = special_tokens or {}
        # No token covers more characters than its vocabulary string has (byte-level
        # strings have one character per byte), so a text of more than
        # max_token_chars * n characters has more than n tokens.
        self.max_token_chars = max(
            (len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1
        )
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._added: dict[str, int] | None = None
        self._late_system: dict[bool, bool] = {}

    @classmethod
    def load(cls, model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load ``tokenizer.json`` and the chat template from ``model_dir``.

        Args:
            chat_template: a Jinja chat template to use instead of the folder's own
                (``--chat-template``), e.g. for a model that has none.

        Raises:
            FileNotFoundError: the folder has no ``tokenizer.json``.
        """
        folder = Path(model_dir)
        backend = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        # Some tokenizer.json files carry training-time truncation and padding (BERT's:
        # cut at 128 tokens, pad to 128): the server counts and refuses lengths itself,
        # and a padded prompt would be another prompt.
        backend.no_truncation()
        backend.no_padding()
        config: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        template = None
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        elif isinstance(config.get("chat_template"), str):
            template = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):  # named templates
            named = {t.get("name"): t.get("template") for t in config["chat_template"]}
            template = named.get("default")
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # {"content": "<s>", ...}
                value = value.get("content")
            if isinstance(value, str):
                special[key] = value
        return cls(backend, chat_template if chat_template is not None else template, special)

    def added_token_id(self, text: str) -> int | None:
        """The id of the added token (special or not) whose text is ``text``, such as a
        reasoning model's ``</think>``; None if no added token has that text."""
        if self._added is None:
            added = self.backend.get_added_tokens_decoder()
            self._added = {token.content: token_id for token_id, token in added.items()}
        return self._added.get(text)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own special tokens, e.g. BOS).

        Releases the GIL while the Rust tokenizer works (``encode_batch`` does, ``encode``
        does not), so a long text can be encoded in a worker thread without stopping the
        event loop.

        Raises:
            InvalidTextError: ``text`` is not encodable (lone surrogates, for example).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTextError(
                f"the text is not valid Unicode: it holds a lone UTF-16 surrogate "
                f"({text[exc.start]!r}) at character {exc.start}"
            ) from exc
        try:
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as exc:  # the Rust binding raises TypeError / ValueError
            raise InvalidTextError(f"the text cannot be tokenized: {exc}") from exc

    def surely_longer_than(self, text: str, num_tokens: int) -> bool:
        """True when ``text`` certainly has more than ``num_tokens`` tokens (no encoding)."""
        return len(text) > num_tokens * self.max_token_chars

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` in one go."""
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (special tokens included), as logprobs show it.

        A token holding part of a multi-byte character decodes to U+FFFD here; use
        `token_bytes` for the exact bytes.
        """
        text = self._token_text.get(token_id)
        if text is None:
            text = self.backend.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The UTF-8 bytes one token contributes to the text (OpenAI's logprob ``bytes``).

        Exact for byte-level BPE and SentencePiece byte-fallback tokens; otherwise the
        UTF-8 encoding of `token_text`.
        """
        cached = self._token_bytes.get(token_id)
        if cached is not None:
            return cached
        piece = self.backend.id_to_token(token_id) or ""
        alphabet = byte_level_alphabet()
        match = _BYTE_TOKEN.fullmatch(piece)
        if self._byte_level and piece and all(ch in alphabet for ch in piece):
            result = [alphabet[ch] for ch in piece]
        elif match:
            result = [int(match.group(1), 16)]
        else:
            result = list(self.token_text(token_id).encode("utf-8", "surrogatepass"))
        self._token_bytes[token_id] = result
        return result

    def renders_late_system(self, tools: bool = False) -> bool:
        """Whether the chat template shows a system message that comes after the first
        message at its place (between the turns around it), rather than refusing it or
        leaving it out; with ``tools``, the template that renders tools (`tool_template`).

        Found once per template by rendering a probe conversation.
        """
        if tools not in self._late_system:
            marks = ["trio-probe-u1", "trio-probe-late-system", "trio-probe-a1"]
            probe = [
                {"role": "system", "content": "trio-probe-s0"},
                {"role": "user", "content": marks[0]},
                {"role": "system", "content": marks[1]},
                {"role": "assistant", "content": marks[2]},
                {"role": "user", "content": "trio-probe-u2"},
            ]
            function = {"name": "probe", "description": "", "parameters": {"type": "object"}}
            try:
                text = self.render_chat(
                    probe, tools=[{"type": "function", "function": function}] if tools else None
                )
                places = [text.index(mark) for mark in marks]
            except Exception:  # refused (raise_exception), left out, or failed: no
                self._late_system[tools] = False
            else:
                self._late_system[tools] = places == sorted(places)
        return self._late_system[tools]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        request_template: str | None = None,
        limits: TemplateLimits | None = None,
    ) -> str:
        """Chat messages (plus, by default, the assistant prompt), rendered with the
        model's template; with ``tools``, with `tool_template` when there is one;
        ``template_kwargs`` are further template variables (vLLM's
        ``chat_template_kwargs``, see `trio_llm.text.chat_template.render_messages`).
        ``request_template`` (a request's ``chat_template``) replaces them all and is
        rendered within ``limits`` (`trio_llm.text.template_guard.render_guarded`: run
        it in a worker thread).

        With ``continue_final_message`` (vLLM's field; Anthropic's assistant prefill) the
        last message, an assistant's, is left open: the text ends right after its content
        (the template's end-of-turn marker cut off), so the model continues it. An empty
        final message is dropped and an assistant prompt opened instead.

        The server encodes the result with ``add_special_tokens=False`` (the template
        writes the special tokens itself).

        Raises:
            ChatTemplateError: the model has no chat template or rendering failed.
        """
        if not self.chat_template and request_template is None:
            raise ChatTemplateError(
                "this model has no chat template: send a plain prompt (/v1/completions), or "
                "give it one with --chat-template (chat_template in the embedding API)"
            )
        prefill = ""
        if continue_final_message:
            if not messages or messages[-1].get("role") != "assistant":
                raise ChatTemplateError("only a final assistant message can be continued")
            prefill = messages[-1].get("content") or ""
            if not prefill:
                messages, add_generation_prompt = messages[:-1], True
            else:
                add_generation_prompt = False
        variables = template_variables(
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        try:
            if request_template is not None:
                text = render_guarded(request_template, variables, limits or DEFAULT_LIMITS)
            else:
                own = (tools and self.tool_template) or self.chat_template or ""
                text = render_template(own, variables)
        except TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        return _left_open(text, prefill) if prefill else text


def _left_open(text: str, prefill: str) -> str:
    """``text`` cut right after the final assistant message's content ``prefill``.

    Raises:
        ChatTemplateError: the template did not write ``prefill`` as given.
    """
    end = text.rfind(prefill)
    if end < 0:
        raise ChatTemplateError(
            "the chat template does not write the final assistant message as given, "
            "so it cannot be continued"
        )
    return text[: end + len(prefill)]
