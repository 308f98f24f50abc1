"""Per-request cost of the gateway's key lookup and prompt token count (issue 17).

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.keys_tokens MODEL_DIR [--repeat 5]

``MODEL_DIR`` holds a ``tokenizer.json`` (``pdctl model tiny DIR`` writes one). Prints microseconds per
``TokenCounter.count`` (the model's tokenizer) and per ``estimate_tokens`` for an English and a Chinese chat
prompt, and per ``KeyRing.identify`` with 1, 100 and 1000 keys. Best of ``--repeat`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import timeit
from collections.abc import Callable
from typing import Any

from pdctl.gateway.keys import KeyEntry, KeyRing, hash_key
from pdctl.gateway.tokens import TokenCounter, estimate_tokens, prompt_parts

PROMPTS = {
    "English, 8.8k characters": "the quick brown fox jumps over the lazy dog " * 200,
    "Chinese, 2.8k characters": "请用中文解释预填充和解码分离" * 200,
}


def best_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Best per-call time in microseconds."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    """Print the table rows."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    counter = TokenCounter()
    counter.load({"m": args.model_dir})
    loop = asyncio.new_event_loop()
    for name, text in PROMPTS.items():
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        exact = best_us(lambda b=body: loop.run_until_complete(counter.count("m", b)), 50, args.repeat)  # type: ignore[misc]
        est = best_us(lambda b=body: estimate_tokens(*prompt_parts(b)), 200, args.repeat)  # type: ignore[misc]
        tokens = loop.run_until_complete(counter.count("m", body))
        print(f"{name}: tokenizer {exact:.0f} us ({tokens} tokens), estimate {est:.1f} us")
    for n in (1, 100, 1000):
        ring = KeyRing(tuple(KeyEntry(f"k{i}", bytes.fromhex(hash_key(f"sk-{i}"))) for i in range(n)))
        print(f"identify, {n} keys: {best_us(lambda r=ring: r.identify(b'Bearer sk-0'), 2000, args.repeat):.1f} us")  # type: ignore[misc]
    loop.close()


if __name__ == "__main__":
    main()
