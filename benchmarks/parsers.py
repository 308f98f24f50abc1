"""CPU cost of the shared client-side parsers: Prometheus text (``pdctl.vllm.promtext``) and SSE (``pdctl.vllm.sse``).

Usage (from the repository root)::

    .venv/bin/python -m benchmarks.parsers [--repeat 5]

Prints milliseconds per ``/metrics`` body (a real vLLM CPU decode worker's, 600 lines, from
tests/fixtures/vllm-cpu) parsed whole and with a polling loop's name filter, and microseconds per streamed
chunk fed to the SSE parser (one vLLM chat chunk per call, as the bench client sees them). Best of
``--repeat`` rounds, so a busy machine inflates the numbers less.
"""

from __future__ import annotations

import argparse
import timeit
from pathlib import Path

from pdctl.testing.invariants import worker_load
from pdctl.vllm.promtext import samples
from pdctl.vllm.sse import SSEParser

ROOT = Path(__file__).resolve().parent.parent
BODY = (ROOT / "tests" / "fixtures" / "vllm-cpu" / "example-connector-decode.metrics.txt").read_text()
CHUNK = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
    b'"delta":{"content":" word"},"logprobs":null,"finish_reason":null}]}\n\n'
)


def best(fn, number: int, repeat: int) -> float:
    """Seconds per call, best of ``repeat`` rounds of ``number`` calls."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    parser = SSEParser()
    rows = [
        ("promtext.samples, whole body", best(lambda: samples(BODY), 20, args.repeat) * 1e3, "ms / body"),
        ("invariants.worker_load (5 names)", best(lambda: worker_load(BODY), 200, args.repeat) * 1e3, "ms / body"),
        ("vllm.sse.SSEParser.feed", best(lambda: parser.feed(CHUNK), 100_000, args.repeat) * 1e6, "µs / chunk"),
    ]
    print("| parser | cost | unit |\n|---|---:|---|")
    for name, value, unit in rows:
        print(f"| {name} | {value:.2f} | {unit} |")


if __name__ == "__main__":
    main()
