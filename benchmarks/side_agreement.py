"""Do the sides of an A/B give the same greedy answers? Each side's output against the first side's, as verify judges.

    python -m benchmarks.side_agreement --model small colocated=http://127.0.0.1:8001 pd=http://127.0.0.1:8000 \\
        adaptive=http://127.0.0.1:8002 [-n 6] [-o agreement.json]

``scripts/ab-demo.sh`` runs it over its sides after the benchmarks. For each of ``-n`` conversations it sends, through
every side in turn, two greedy completions (``pdctl.verify.link.greedy_body``: temperature 0, ``ignore_eos``, top-k
logprobs): a long fresh prompt (about ``--long-words`` words: both legs under adaptive PD), then the same prompt
extended by a short follow-up (under adaptive PD served by the decode that holds the first, ``x-pd-path: local``),
and one short fresh prompt (local under adaptive PD's defaults). Every answer is compared, token for token, with the
first side's answer to the same prompt by verify's rule (:func:`pdctl.verify.proof.first_divergence`): identical, a
near-tie flip (the two sides' logprobs within verify's tolerance at the first different token; CPU kernels are not
batch-invariant), or diverged (a clear margin: a real difference). The key comes from ``PDCTL_API_KEY``. Prompts are
unique per run (a random nonce) but the same on every side, and the sides share their engines: a later side may find
a prompt in an engine's prefix cache that an earlier side put there. An exact-view side sees that in the engines'
KV events (and may then serve the long prompt locally); an approximate side only knows its own gateway's traffic.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from pdctl.verify.link import greedy_body
from pdctl.verify.proof import Sample, first_divergence, parse_sample

_WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _prompts(nonce: str, i: int, long_words: int) -> list[tuple[str, str]]:
    base = f"Conversation {nonce}-{i}. " + " ".join(_WORDS[(i + j) % len(_WORDS)] for j in range(long_words))
    return [
        ("long", base),
        ("long+followup", base + " Now, in one line, what comes next?"),
        ("short", f"Question {nonce}-{i}: name a colour."),
    ]


def _ask(client: httpx.Client, url: str, model: str, prompt: str, key: str) -> tuple[Sample | None, str | None]:
    r = client.post(f"{url.rstrip('/')}/v1/completions", json=greedy_body(model, prompt),
                    headers={"Authorization": f"Bearer {key}"})  # fmt: skip
    if r.status_code != 200:
        return None, f"HTTP {r.status_code}"
    return parse_sample(r.json()), r.headers.get("x-pd-path")


def _verdict(ref: Sample | None, got: Sample | None) -> str:
    if ref is None or got is None:
        return "no output"
    div = first_divergence(ref, got)
    return "identical" if div is None else ("near-tie" if div.verdict == "tie" else "diverged")


def run(sides: list[tuple[str, str]], model: str, n: int, long_words: int, key: str) -> dict[str, Any]:
    """Every prompt through every side; per side the verdicts against the first side, and the paths taken."""
    nonce = uuid.uuid4().hex[:8]
    verdicts: dict[str, Counter[str]] = {name: Counter() for name, _ in sides[1:]}
    paths: dict[str, Counter[str]] = {name: Counter() for name, _ in sides}
    details: list[dict[str, Any]] = []
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        for i in range(n):
            answers: dict[str, dict[str, Sample | None]] = {}
            for name, url in sides:  # a side's whole conversation, then the next side's
                answers[name] = {}
                for kind, prompt in _prompts(nonce, i, long_words):
                    sample, path = _ask(client, url, model, prompt, key)
                    answers[name][kind] = sample
                    paths[name][f"{kind}: {path}"] += 1
            ref_name = sides[0][0]
            for name, _ in sides[1:]:
                for kind, ref in answers[ref_name].items():
                    v = _verdict(ref, answers[name][kind])
                    verdicts[name][v] += 1
                    details.append({"conversation": i, "side": name, "prompt": kind, "verdict": v})
    return {
        "reference": sides[0][0],
        "model": model,
        "verdicts": {k: dict(v) for k, v in verdicts.items()},
        "paths": {k: dict(v) for k, v in paths.items()},
        "details": details,
    }


def _side(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sides", nargs="+", type=_side, help="NAME=URL, the reference first")
    ap.add_argument("--model", required=True)
    ap.add_argument("-n", type=int, default=6, help="conversations (default 6)")
    ap.add_argument("--long-words", type=int, default=600, help="words of the long prompt (default 600)")
    ap.add_argument("-o", "--output", type=Path, help="write the verdicts and paths as JSON")
    args = ap.parse_args(argv)
    if len(args.sides) < 2:
        ap.error("give at least two sides: the reference and one to compare")
    key = os.environ.get("PDCTL_API_KEY", "")
    try:
        result = run(args.sides, args.model, args.n, args.long_words, key)
    except httpx.HTTPError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, counts in result["verdicts"].items():
        shown = ", ".join(f"{v} {c}" for v, c in sorted(counts.items()))
        print(f"{name} vs {result['reference']}: {shown}")
    for name, counts in result["paths"].items():
        print(f"{name} paths: " + ", ".join(f"{p} x{c}" for p, c in sorted(counts.items())))
    if args.output:
        args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 1 if any(c.get("diverged") or c.get("no output") for c in result["verdicts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
