"""Text to token ids and back with a model's tokenizer (and its chat template)."""

from __future__ import annotations

from typing import Sequence


class TextCodec:
    """Prompts to token ids (raw text as is, chat messages through the model's chat template) and back, and the
    tokens that end a generation: what the CLI and the server share, so their outputs agree."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        eos = set(eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.stop_token_ids = tuple(sorted(eos))

    def encode(self, prompt: str | None = None, messages: Sequence[dict] | None = None) -> list[int]:
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if messages is not None:
            if not messages:
                raise ValueError("messages is empty")
            ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
        return list(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
