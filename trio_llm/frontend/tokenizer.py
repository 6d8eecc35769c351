"""The API server's tokenizer: prompts and chat messages to token ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as FastTokenizer


class ChatTemplateError(ValueError):
    """The messages could not be rendered with the model's chat template."""


class Tokenizer:
    """Wraps a Hugging Face tokenizer loaded from a local model folder.

    Attributes:
        backend: the fast ``tokenizers.Tokenizer`` (used by the detokenizer).
    """

    def __init__(self, hf_tokenizer: Any) -> None:
        self._hf = hf_tokenizer
        self.backend: FastTokenizer = hf_tokenizer.backend_tokenizer

    @classmethod
    def load(cls, model_dir: str | Path) -> Tokenizer:
        """Load the tokenizer (and chat template) saved in ``model_dir``; no network."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (the tokenizer's BOS added when it adds one by default)."""
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids`` in one go."""
        return self.backend.decode(token_ids, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Render chat messages with the model's template plus the assistant prompt; ids.

        Raises:
            ChatTemplateError: the model has no chat template or rendering failed.
        """
        if not getattr(self._hf, "chat_template", None):
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            text = self._hf.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # jinja errors, template-raised exceptions
            raise ChatTemplateError(f"cannot apply the chat template: {exc}") from exc
        return self._hf.encode(text, add_special_tokens=False)
