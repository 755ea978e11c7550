"""Token in, token out: the prompt's tokens, and an environment turn's tokens as exactly what
the chat template adds after the model's turn, so that the sequence the trainer sees is the
one the engine generated from (no decoding and re-encoding of the model's tokens, nothing
lost at the seam between turns).

An environment turn is rendered as the difference between the template's rendering of a
fixed conversation with and without the new messages (the generation prompt included), put
after what the template writes between the end of an assistant turn (its end-of-sequence
token, where generation stopped) and the next message: Qwen's newline after
``<|im_end|>``, which a model never samples."""

from __future__ import annotations

from typing import Any

from ..errors import RunError
from ..rollout.common import Example

__all__ = ["ChatRenderer"]

_HEAD = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


class ChatRenderer:
    """Renders prompts and environment turns to token ids with ``tokenizer``'s chat
    template; ``tools``: the tools' JSON schemas, given to the template with the prompt."""

    def __init__(self, tokenizer, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer, self.tools = tokenizer, tools or None
        if not getattr(tokenizer, "chat_template", None):
            raise RunError(
                "agent: the model's tokenizer has no chat template (tokenizer_config.json "
                "'chat_template'); multi-turn rollouts render environment turns with it"
            )
        self.eos = tokenizer.eos_token_id
        self.head = self._ids(_HEAD, generation=False)
        ends = [i for i, t in enumerate(self.head) if t == self.eos]
        if not ends:
            raise RunError(
                "agent: the chat template does not end an assistant turn with the tokenizer's "
                f"end-of-sequence token {tokenizer.eos_token!r}, where generation stops; use a "
                "tokenizer whose eos_token is the end-of-turn token"
            )
        self.separator = self.head[ends[-1] + 1 :]
        """What the template writes after an assistant turn's end token, before the next."""

    def _ids(self, messages: list[dict[str, Any]], *, generation: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, example: Example) -> list[int]:
        """The prompt's tokens: its chat ``messages`` rendered with the tools and the
        generation prompt, or its text as it is (already rendered)."""
        if example.messages:
            return self._ids(list(example.messages), generation=True)
        return self.tokenizer(example.prompt, add_special_tokens=False)["input_ids"]

    def turn(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens that follow a model turn ended by its end-of-sequence token: the
        template's separator, ``messages`` and the next generation prompt."""
        full = self._ids([*_HEAD, *messages], generation=True)
        if full[: len(self.head)] != self.head:
            raise RunError(
                "agent: the chat template renders earlier turns differently once more "
                "messages follow; token-exact multi-turn rollouts need a template that only "
                "appends"
            )
        return self.separator + full[len(self.head) :]
