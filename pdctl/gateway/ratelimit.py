"""``gateway.rate_limit``: requests/minute, tokens/minute and a concurrency cap.

All three are checked before any is charged, so a request refused by one limit consumes none of the
others (LiteLLM#39309). Windows slide over the last 60 s.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from pdctl.config import RateLimitConfig
from pdctl.gateway.errors import ApiError

__all__ = ["RateLimiter"]

WINDOW_S = 60.0


class RateLimiter:
    """Admit or refuse one request; ``release()`` when an admitted request ends."""

    def __init__(self, config: RateLimitConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
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
        self.charge(tokens)

    def check(self, tokens: int, who: str = "") -> None:
        """Raise a 429 :class:`ApiError` if one request of ``tokens`` would exceed a limit; charges nothing.

        ``who``: what the limit belongs to in the message (a key's name), empty for the gateway's own limits.
        """
        c = self.config
        now = self.clock()
        self._expire(now)
        of = f" for key {who!r}" if who else ""
        if c.max_concurrency is not None and self.active >= c.max_concurrency:
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

    def charge(self, tokens: int) -> None:
        """Count one admitted request of ``tokens`` tokens (after :meth:`check` passed)."""
        c = self.config
        now = self.clock()
        self.active += 1
        if c.requests_per_minute is not None:
            self._requests.append(now)
        if c.tokens_per_minute is not None:
            self._tokens.append((now, tokens))
            self._token_sum += tokens

    def release(self) -> None:
        """An admitted request ended."""
        self.active -= 1
