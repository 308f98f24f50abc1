"""The plan of one request (:class:`RoutePlan`): its decode, what that decode holds of the prompt, local or over both
legs and why, and every pick made for it; and the rule that decides local or disaggregated (:func:`local_rule`).

The rule, following llm-d's ``prefix-based-pd-decider`` and Dynamo's conditional disaggregation (llm-d/llm-d PR
#2109; ai-dynamo/dynamo ``docs/components/router/router-disaggregated-serving.md``): with ``uncached`` the
prompt's tokens not cached on the chosen decode, local (that decode alone computes the rest, ``x-pd-path: local``)
when ``uncached <= routing.local_max_uncached_tokens`` and ``uncached / prompt <= routing.local_max_uncached_share``
and the decode has fewer than ``routing.local_max_decode_requests`` requests in flight and, with streams in
flight, the prefill would stall them at most ``routing.local_max_stall_ms`` (uncached tokens × the prefill seconds
per token the admission predictor measured on leg 1s: the same cores compute it); otherwise P→D.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pdctl.config import RoutingConfig
from pdctl.gateway import agent_sessions
from pdctl.gateway.routing.pool import Instance

__all__ = ["Reason", "RoutePlan", "View", "local_rule"]

Reason = Literal["cached", "uncached_tokens", "uncached_share", "decode_busy", "decode_stall", "always", "auto"]
"""Why a request goes local (``cached``) or over both legs; ``always``: ``pd_mode = "always"``, no decision;
``auto``: the SLO autopilot chose (:mod:`pdctl.gateway.routing.autopilot`)."""
View = Literal["approx", "exact"]


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class RoutePlan:
    """Where one request goes, and why (one object per request: compared and hashed by identity)."""

    local: bool
    reason: Reason
    decode: Instance | None
    """The decode chosen first (None: no decode available)."""
    cached_tokens: int
    uncached_tokens: int
    hashes: tuple[int, ...]
    """The approximate view's block hashes of the prompt (recorded on the instances that serve it)."""
    view: View = "approx"
    """The view the decision was made with: ``exact`` when the prompt's token ids and the decode's events were
    known (``routing.prefix_view = "exact"``)."""
    token_ids: tuple[int, ...] | None = None
    """The prompt's exact token ids (``prefix_view = "exact"`` only)."""
    approx_cached_tokens: int | None = None
    """Under the exact view, what the approximate view would have counted as cached on the same decode."""
    chars: int = 0
    """The length of the prompt's text (:func:`prompt_text`), to turn approximate blocks into tokens."""
    approx_local: bool | None = None
    """Under the exact view, whether the approximate view would have gone local (the views' drift)."""
    session: str | None = None
    """The request's session hint (:func:`pdctl.gateway.agent_sessions.session_hint`), for tie-breaks."""
    picks: list[str] = field(default_factory=list, compare=False, hash=False)
    """Each pick's access-log fields so far (:meth:`pdctl.gateway.routing.policies.Pick.log_fields`), in order."""
    identity: agent_sessions.Identity | None = None
    """The request's agent session (:func:`pdctl.gateway.agent_sessions.identify`)."""
    cache_break: agent_sessions.Break | None = None
    """How the prompt compares with its session's previous turn (None: no session, or its first turn)."""

    def log_fields(self) -> str:
        """The decision as access-log fields, with every pick made so far and its candidates' scores."""
        if self.reason == "always":
            fields = "decision=always"
        else:
            fields = f"decision={self.reason} cached_tokens={self.cached_tokens} uncached_tokens={self.uncached_tokens}"
        if self.view == "exact":
            fields += f" view=exact approx_cached_tokens={self.approx_cached_tokens}"
        if self.identity is not None:
            fields += " " + self.identity.log_fields()
        if self.cache_break is not None:
            fields += " " + self.cache_break.log_fields()
        return " ".join([fields, *self.picks])


def local_rule(
    r: RoutingConfig,
    decode: Instance | None,
    uncached: int,
    prompt_tokens: int,
    sec_per_token: Callable[[], float | None],
) -> Reason:
    """``cached`` when the decode serves the request alone, else why not (module docstring)."""
    if uncached > r.local_max_uncached_tokens:
        return "uncached_tokens"
    if uncached > r.local_max_uncached_share * prompt_tokens:
        return "uncached_share"
    if decode is not None and r.local_max_decode_requests is not None:
        if decode.in_flight >= r.local_max_decode_requests:
            return "decode_busy"
    if decode is not None and decode.in_flight > 0 and r.local_max_stall_ms is not None:
        spt = sec_per_token()
        if spt is not None and uncached * spt * 1000.0 > r.local_max_stall_ms:
            return "decode_stall"
    return "cached"
