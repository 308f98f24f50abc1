"""The simulator's deterministic toy tokenizer, chat template and output vocabulary.

Pieces are special tokens (``<|im_start|>``), runs of letters with their leading space, single digits and
single other characters (CJK, punctuation); a piece's id is a CRC32 of its text modulo the vocabulary size.
Generated tokens are words from a fixed list, so their ids tokenize back to themselves.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["VOCAB_SIZE", "WORDS", "Tokenizer", "apply_chat_template", "content_text"]

VOCAB_SIZE = 151936
_PIECE = re.compile(r"<\|[a-z_]+\|>| ?[A-Za-z]+| ?\d| ?[^\sA-Za-z\d]|\s+")

WORDS: tuple[str, ...] = tuple(
    (
        "the of and to in is that for it as with was on be by at this are from or an which have but not "
        "they his one all were we their there been has more when will would who so if out no can up about "
        "what said into its than them only time some could these two may first then do any like other new "
        "cache model token prefill decode layer batch memory stream latency"
    ).split()
)


class Tokenizer:
    """Toy tokenizer; ``variant`` != 0 gives different ids for the same text (the wrong-tokenizer fault)."""

    def __init__(self, variant: int = 0) -> None:
        self.variant = variant
        self._salt = b"" if variant == 0 else f"v{variant}:".encode()
        self.word_ids: tuple[int, ...] = tuple(self.piece_id(" " + w) for w in WORDS)
        self._by_id: dict[int, str] = {tid: " " + w for tid, w in zip(self.word_ids, WORDS, strict=True)}

    def piece_id(self, piece: str) -> int:
        """The id of one piece."""
        return zlib.crc32(self._salt + piece.encode("utf-8")) % VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""
        return [self.piece_id(p) for p in _PIECE.findall(text)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids (unknown ids render as ``<id>``)."""
        return "".join(self._by_id.get(i, f"<{i}>") for i in ids)

    def token_text(self, tid: int) -> str:
        """Text of one generated id."""
        return self._by_id.get(tid, f"<{tid}>")


def content_text(content: Any) -> str:
    """A chat message's ``content`` as text (string, or a list of ``{"type": "text"}`` parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError("content must be a string or a list of text parts")


def apply_chat_template(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """A ChatML prompt (Qwen's format) for ``messages``."""
    out = []
    for m in messages:
        role = str(m.get("role", "user"))
        out.append(f"<|im_start|>{role}\n{content_text(m.get('content'))}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
