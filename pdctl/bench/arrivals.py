"""When requests are sent: open-loop Poisson/gamma arrivals, as ``vllm bench serve`` generates them.

Inter-arrival gaps are drawn from a gamma distribution with shape ``burstiness`` (k) and scale
``1 / (rate * k)``: the mean gap is ``1 / rate`` whatever k is; k = 1 is a Poisson process, k < 1 is burstier
(coefficient of variation ``1 / sqrt(k)``), k > 1 smoother, k = inf a constant spacing. As in vLLM the
accumulated offsets are rescaled so that the last request is sent at exactly ``n / rate``, which makes the
achieved rate of a finite run equal the asked one. ``rate = inf`` sends everything at t = 0.

A fixed concurrency is not an arrival process: the runner keeps N requests in flight (closed loop).
"""

from __future__ import annotations

import math
import random

from pdctl.errors import PdctlError

__all__ = ["ArrivalError", "arrival_offsets", "parse_rates"]


class ArrivalError(PdctlError):
    """A rate or burstiness value that cannot drive an arrival process."""


def arrival_offsets(
    n: int, rate: float, burstiness: float = 1.0, seed: int = 0, *, rescale: bool = True
) -> list[float]:
    """Send times (seconds from the start, non-decreasing) of ``n`` requests at ``rate`` requests/s."""
    if n < 0:
        raise ArrivalError(f"the number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ArrivalError(f"--rate must be > 0, got {rate}", hint="use inf to send everything at once")
    if not burstiness > 0:
        raise ArrivalError(f"--burstiness must be > 0, got {burstiness}", hint="1.0 is a Poisson process")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * n
    else:
        rng = random.Random(seed)
        theta = 1.0 / (rate * burstiness)
        gaps = [rng.gammavariate(burstiness, theta) for _ in range(n)]
    offsets: list[float] = []
    total = 0.0
    for gap in gaps:
        total += gap
        offsets.append(total)
    if rescale and total > 0:
        factor = (n / rate) / total
        offsets = [t * factor for t in offsets]
    return offsets


def parse_rates(text: str) -> list[float]:
    """``"1,2,4"`` / ``"0.5:4:0.5"`` (start:stop:step, inclusive) / ``"inf"`` -> a list of rates."""
    rates: list[float] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            if ":" in part:
                start_s, stop_s, step_s = part.split(":")
                start, stop, step = float(start_s), float(stop_s), float(step_s)
                if step <= 0 or start <= 0 or stop < start:
                    raise ValueError
                count = math.floor((stop - start) / step + 1e-9) + 1
                rates.extend(round(start + i * step, 9) for i in range(count))
            else:
                value = float(part)
                if not value > 0:
                    raise ValueError
                rates.append(value)
        except ValueError:
            raise ArrivalError(
                f"--rate: cannot read {part!r}",
                hint="give rates > 0 as 1,2,4 or a sweep start:stop:step like 1:8:1, or inf",
            ) from None
    if not rates:
        raise ArrivalError("--rate: no rate given", hint="e.g. --rate 2 or --rate 1,2,4")
    return rates
