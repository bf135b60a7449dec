"""A request's prompt tokens where the `kv_cache` routing decision is taken, with the model's own tokenizer (Hugging
Face's, as vLLM loads it) and chat template, the way vLLM's OpenAI layer makes them: a completion's prompt with the
tokenizer's special tokens, a chat's messages rendered by the template and tokenized without adding any.

A mismatch costs a cache hit, never an answer: the replica tokenizes for itself."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from app.config.env import expand_env

logger = logging.getLogger("ray.serve")

MAX_CHARS = 200_000  # of a prompt tokenized for routing; a longer one's tail is left out (and its last block)
_THREAD_CHARS = 8_000  # a prompt at least this long is tokenized off the router's event loop


class PromptTokens:
    def __init__(self, tokenizer: str | None, chat_template: str | None = None):
        self.source, self.chat_template = tokenizer, chat_template
        self._tokenizer: Any = None
        self._failed = False
        self._loading: asyncio.Task | None = None

    async def of(self, body: Mapping[str, Any] | None) -> tuple[list[int], bool] | None:
        """(tokens, cut): the prompt's tokens and whether its tail was cut off; None when there is no prompt to
        route on (or no tokenizer)."""
        if not body or not self.source or self._failed:
            return None
        if self._tokenizer is None:
            if self._loading is None:
                self._loading = asyncio.get_running_loop().create_task(asyncio.to_thread(self._load))
            await asyncio.shield(self._loading)
            if self._tokenizer is None:
                return None
        if "messages" in body:
            text = self._chat_text(body)
            return None if text is None else await self._encode(text, special=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]  # several prompts: the first decides
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt, False
        if isinstance(prompt, str) and prompt:
            return await self._encode(prompt, special=True)
        return None

    def _load(self) -> None:
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(expand_env(self.source))
            if self.chat_template and os.path.isfile(self.chat_template):
                with open(self.chat_template, encoding="utf-8") as f:
                    self.chat_template = f.read()
        except Exception as e:  # noqa: BLE001 — routed by load instead
            self._failed = True
            logger.warning("kv_cache routing: no tokenizer from %r (%s); requests go by load", self.source, e)

    def _chat_text(self, body: Mapping[str, Any]) -> str | None:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        flat = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: vLLM joins the text parts with newlines
                parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
                content = "\n".join(p.get("text", "") for p in parts)
            flat.append({**m, "content": content})
        try:
            return self._tokenizer.apply_chat_template(
                flat,
                chat_template=self.chat_template,
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                tokenize=False,
            )
        except Exception:  # noqa: BLE001 — a conversation the template refuses: the replica answers it
            return None

    async def _encode(self, text: str, special: bool) -> tuple[list[int], bool]:
        cut = len(text) > MAX_CHARS
        text = text[:MAX_CHARS]

        def encode() -> list[int]:
            return self._tokenizer(text, add_special_tokens=special)["input_ids"]

        ids = await asyncio.to_thread(encode) if len(text) >= _THREAD_CHARS else encode()
        return ids, cut
