"""A model's context length, found the way vLLM derives its default ``max_model_len``, without loading weights.

Where it looks, in order (the first that answers wins):

1. a local model folder's ``config.json`` (and ``tokenizer_config.json``);
2. the Hugging Face cache: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``, in
   ``models--ORG--NAME/snapshots/*/config.json``;
3. :data:`WELL_KNOWN`, a small table of models whose numbers were read from their published ``config.json``.

Otherwise the length is unknown, and callers say so. The rule copies vLLM 0.32's
``derive_max_model_len_and_key`` and ``_get_and_verify_max_len``: the smallest of the length keys, capped by the
tokenizer's ``model_max_length``, times the RoPE scaling factor except for the YaRN/Llama-3 types that are already
scaled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["WELL_KNOWN", "ContextLength", "context_length", "context_length_from_config", "read_json_object"]

#: Context lengths (tokens) of well-known models: ``max_position_embeddings`` of each model's config.json on
#: huggingface.co/<name>/blob/main/config.json (read 2026-12). Every Qwen3 dense model has 40960.
WELL_KNOWN: Mapping[str, int] = {
    "Qwen/Qwen3-0.6B": 40960,
    "Qwen/Qwen3-1.7B": 40960,
    "Qwen/Qwen3-4B": 40960,
    "Qwen/Qwen3-8B": 40960,
    "Qwen/Qwen3-14B": 40960,
    "Qwen/Qwen3-32B": 40960,
    "Qwen/Qwen2.5-7B-Instruct": 32768,
    "meta-llama/Llama-3.1-8B-Instruct": 131072,
    "facebook/opt-125m": 2048,
}

# vLLM's possible_keys, in its order.
_LENGTH_KEYS = (
    "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
    "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len",
)  # fmt: skip
_PRESCALED_ROPE = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})


@dataclass(frozen=True, slots=True)
class ContextLength:
    """A model's context length in tokens (``None`` when unknown) and where that number came from."""

    tokens: int | None
    source: str


def context_length_from_config(
    config: Mapping[str, Any], tokenizer_config: Mapping[str, Any] | None = None
) -> int | None:
    """vLLM's derived ``max_model_len`` for a parsed ``config.json``; ``None`` when it has no length key."""
    nested = config.get("text_config")
    text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
    lengths = [v for k in _LENGTH_KEYS if isinstance(v := text.get(k), int | float) and not isinstance(v, bool)]
    if not lengths:
        return None
    derived = float(min(lengths))
    if isinstance(text.get("model_max_length"), int | float):
        derived = float(text["model_max_length"])
    if tokenizer_config and isinstance(tok := tokenizer_config.get("model_max_length"), int | float):
        derived = min(derived, float(tok))
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    if isinstance(rope, Mapping) and "gemma3" not in str(config.get("model_type", "")):
        kind = rope.get("rope_type", rope.get("type", "default"))
        factor = rope.get("factor")
        if kind not in _PRESCALED_ROPE and isinstance(factor, int | float):
            derived *= factor
    return int(derived)


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _from_folder(folder: Path) -> int | None:
    config = read_json_object(folder / "config.json")
    if config is None:
        return None
    return context_length_from_config(config, read_json_object(folder / "tokenizer_config.json"))


def _hub_cache(env: Mapping[str, str]) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path("~/.cache/huggingface/hub").expanduser()


def context_length(model: str, *, local: bool, env: Mapping[str, str] | None = None) -> ContextLength:
    """The context length of ``model``: a folder path when ``local``, else a Hugging Face name."""
    if local:
        folder = Path(model).expanduser()
        tokens = _from_folder(folder)
        where = f"{folder / 'config.json'}"
        return ContextLength(tokens, where if tokens is not None else f"unknown: no length in {where}")
    repo = _hub_cache(os.environ if env is None else env) / ("models--" + model.replace("/", "--"))
    for snapshot in sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime, reverse=True):
        if (tokens := _from_folder(snapshot)) is not None:
            return ContextLength(tokens, f"the Hugging Face cache ({snapshot / 'config.json'})")
    if model in WELL_KNOWN:
        return ContextLength(WELL_KNOWN[model], f"pdctl's table of well-known models ({model}'s config.json)")
    return ContextLength(None, f"unknown: {model} is not in the Hugging Face cache nor pdctl's table")
