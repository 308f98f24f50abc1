"""``gateway.rate_limit``: requests/minute, tokens/minute and a concurrency cap.

All three are checked before any is charged, so a request refused by one limit consumes none of the
others (LiteLLM#39309). Windows slide over the last 60 s. The gateway takes a request's concurrency slot
(:meth:`RateLimiter.hold`) before it reads the body, so a key at ``max_concurrency`` cannot have more bodies in
the gateway's memory than that; the request and its tokens are charged once the body is read and counted.

With ``gateway.workers = N`` each gateway process enforces its **share** of every limit (:func:`share_of`:
the limit split by N, the remainder to the first processes), so the sum over the processes is the limit and
it holds whatever process a connection lands on, with no state shared between them. The price: one client
whose connections all land on one process is refused at that process's share (docs/gateway.md).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from pdctl.config import RateLimitConfig
from pdctl.gateway.errors import ApiError

__all__ = ["RateLimiter", "share_of"]

WINDOW_S = 60.0


def share_of(config: RateLimitConfig, share: tuple[int, int]) -> RateLimitConfig:
    """Process ``index``'s part of each limit, for ``share = (index, processes)``; the parts sum to the limit."""
    index, n = share
    if n == 1:
        return config

    def part(limit: int | None) -> int | None:
        return None if limit is None else limit // n + (1 if index < limit % n else 0)

    return replace(
        config,
        requests_per_minute=part(config.requests_per_minute),
        tokens_per_minute=part(config.tokens_per_minute),
        max_concurrency=part(config.max_concurrency),
    )


class RateLimiter:
    """Admit or refuse one request; ``release()`` when an admitted request ends.

    ``share = (index, processes)``: this gateway process's share of ``config`` (:func:`share_of`).
    """

    def __init__(
        self, config: RateLimitConfig, clock: Callable[[], float] = time.monotonic, share: tuple[int, int] = (0, 1)
    ) -> None:
        self.config = share_of(config, share)
        self.configured = config
        self.processes = share[1]
        self.clock = clock
        self.active = 0
        self._requests: deque[float] = deque()
        self._tokens: deque[tuple[float, int]] = deque()
        self._token_sum = 0

    def _expire(self, now: float) -> None:
        cutoff = now - WINDOW_S
        while self._requests and self._requests[0] <= cutoff:
            self._requests.popleft()
        while self._tokens and self._tokens[0][0] <= cutoff:
            self._token_sum -= self._tokens.popleft()[1]

    def acquire(self, tokens: int) -> None:
        """Charge one request of ``tokens`` tokens, or raise a 429 :class:`ApiError`."""
        self.check(tokens)
        self.hold()
        self.charge(tokens)

    def check(self, tokens: int, who: str = "", held: bool = False) -> None:
        """Raise a 429 :class:`ApiError` if one request of ``tokens`` would exceed a limit; charges nothing.

        ``who``: what the limit belongs to in the message (a key's name), empty for the gateway's own limits;
        ``held``: the request already holds its concurrency slot (:meth:`hold`), so concurrency is not checked again.
        """
        c = self.config
        now = self.clock()
        self._expire(now)
        of = f" for key {who!r}" if who else ""
        if self.processes > 1:
            of += f" (this gateway process's share; gateway.workers = {self.processes} split each limit)"
        if not held and c.max_concurrency is not None and self.active >= c.max_concurrency:
            raise ApiError(
                429, f"too many concurrent requests{of} (max_concurrency = {c.max_concurrency})",
                code="rate_limit_exceeded", retry_after_s=1, reason="max_concurrency",
            )  # fmt: skip
        if c.requests_per_minute is not None and len(self._requests) >= c.requests_per_minute:
            wait = self._requests[0] + WINDOW_S - now
            raise ApiError(
                429, f"rate limit reached{of}: {c.requests_per_minute} requests per minute",
                code="rate_limit_exceeded", retry_after_s=wait, reason="requests_per_minute",
            )  # fmt: skip
        if c.tokens_per_minute is not None and self._token_sum + tokens > c.tokens_per_minute:
            if tokens > c.tokens_per_minute:
                raise ApiError(
                    429, f"this request (~{tokens} tokens) exceeds the limit{of} of {c.tokens_per_minute} tokens per "
                    "minute; lower max_tokens or shorten the prompt", code="rate_limit_exceeded",
                    should_retry=False, retry_after_s=WINDOW_S, reason="tokens_per_minute",
                )  # fmt: skip
            need = self._token_sum + tokens - c.tokens_per_minute
            wait = WINDOW_S
            freed = 0
            for t, n in self._tokens:
                freed += n
                if freed >= need:
                    wait = t + WINDOW_S - now
                    break
            raise ApiError(
                429, f"rate limit reached{of}: {c.tokens_per_minute} tokens per minute",
                code="rate_limit_exceeded", retry_after_s=wait, reason="tokens_per_minute",
            )  # fmt: skip

    def hold(self) -> None:
        """Take one concurrency slot (after :meth:`check` passed); :meth:`release` gives it back."""
        self.active += 1

    def charge(self, tokens: int) -> None:
        """Count one admitted request of ``tokens`` tokens (after :meth:`check` passed, its slot held)."""
        c = self.config
        now = self.clock()
        if c.requests_per_minute is not None:
            self._requests.append(now)
        if c.tokens_per_minute is not None:
            self._tokens.append((now, tokens))
            self._token_sum += tokens

    def release(self) -> None:
        """A request that held a slot (:meth:`hold`) ended."""
        self.active -= 1
