"""The recipe's two test requests (its section 4), in its own words: declared once.

Read by ``pdctl up``'s closing curl lines, ``pdctl verify`` (chat and stream checks), the bench's ``doc``
workload and the tiny model's tokenizer training text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT", "RECIPE_REQUESTS", "STREAM", "RecipeRequest"]


@dataclass(frozen=True, slots=True)
class RecipeRequest:
    """One of the recipe's chat requests: prompt, output length, streamed or not."""

    prompt: str
    max_tokens: int
    stream: bool

    def body(self, model: str) -> dict[str, Any]:
        """The ``/v1/chat/completions`` body, keys in the recipe's order."""
        return {
            "model": model,
            "messages": [{"role": "user", "content": self.prompt}],
            "max_tokens": self.max_tokens,
            "stream": self.stream,
        }


CHAT = RecipeRequest("用一句话解释 KV Cache", 32, stream=False)
STREAM = RecipeRequest("写一段 200 字的自我介绍", 256, stream=True)
RECIPE_REQUESTS = (CHAT, STREAM)
