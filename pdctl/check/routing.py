"""Rules about how the gateway routes: adaptive PD's thresholds, the prefix views, the routing policies.

- :func:`adaptive` PD033: ``routing.pd_mode = "adaptive"`` with thresholds that send every request one way
  (``local_max_uncached_tokens = 0``: always the two legs; a threshold at the decode's context length with no
  share rule and no request cap: always local, colocated in all but name), or with ``strategy = "colocated"``,
  where it changes nothing.
- :func:`exact_view` PD034: ``routing.prefix_view = "exact"`` where it changes nothing (``strategy =
  "colocated"``) or this gateway does not read it (``pd_mode = "always"`` and no ``kv_aware`` policy: the workers
  still publish, for another gateway over them); an error when a ``kv_aware`` policy has no exact view to read.
- :func:`several_processes` PD038: a ``cache_aware`` or ``kv_aware`` policy or the prefill queue with
  ``gateway.workers`` > 1: each process learns only its own share of the traffic, so the processes scatter a prefix
  (docs/performance.md, "xPyD routing policies"), and each queue counts only its own requests against a prefill's
  room (not on the exact view, whose events every process receives).
- :func:`queue_view` PD039: the prefill queue on the approximate view at its default size: the view never forgets
  what a prefill computed, so ``match`` holds requests for prefills that evicted their prefix.
"""

from __future__ import annotations

from collections.abc import Iterable

from pdctl.check.findings import SETTINGS, Ctx, Finding
from pdctl.config import RoutingConfig

#: ``routing.local_max_uncached_tokens``' declared default, offered as the way back to a decision that splits.
_DEFAULT_TOKENS = RoutingConfig().local_max_uncached_tokens


def adaptive(c: Ctx) -> Iterable[Finding]:
    """PD033: adaptive PD whose thresholds send every request one way, or that the strategy ignores."""
    r = c.dep.routing
    if r.pd_mode != "adaptive":
        return
    if r.strategy == "colocated":
        yield c.at("PD033", "info", "settings", "routing.pd_mode",
                   "pd_mode \"adaptive\" changes nothing under strategy \"colocated\" (every request already goes "
                   "to one worker)", fixes=({f"{SETTINGS}routing.pd_mode": "always"},))  # fmt: skip
        return
    key = "routing.local_max_uncached_tokens"
    if r.local_max_uncached_tokens == 0:
        yield c.at("PD033", "warning", "settings", key,
                   "local_max_uncached_tokens = 0 sends every request over both legs: a prompt always has at least "
                   "one token the decode has not cached",
                   fixes=({f"{SETTINGS}{key}": _DEFAULT_TOKENS}, {f"{SETTINGS}routing.pd_mode": "always"}))  # fmt: skip
        return
    lens = [n for n in (c.max_model_len(w) for w in c.dep.decode) if n is not None]
    longest = min(lens, default=None)
    if (longest is not None and r.local_max_uncached_tokens >= longest and r.local_max_uncached_share >= 1.0
            and r.local_max_decode_requests is None):  # fmt: skip
        yield c.at("PD033", "warning", "settings", key,
                   f"local_max_uncached_tokens = {r.local_max_uncached_tokens} is at least decode's max_model_len "
                   f"({longest}), with no share rule and no request cap: every request goes to decode alone and "
                   "long prompts stall its streams as on a colocated engine",
                   fixes=({f"{SETTINGS}{key}": min(_DEFAULT_TOKENS, longest - 1)},
                          {f"{SETTINGS}routing.pd_mode": "always"}))  # fmt: skip


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def exact_view(c: Ctx) -> Iterable[Finding]:
    """PD034: the exact prefix view without adaptive PD or ``kv_aware`` to use it, or ``kv_aware`` without it."""
    r = c.dep.routing
    if r.prefix_view != "exact":
        for which in ("prefill_policy", "decode_policy"):
            if getattr(r, which) == "kv_aware" and r.strategy == "pd_disagg":
                yield c.at("PD034", "error", "settings", f"routing.{which}",
                           "kv_aware reads the workers' KV cache events, but prefix_view is \"approx\": the workers "
                           "get no --kv-events-config and the gateway would refuse to start",
                           fixes=({f"{SETTINGS}routing.prefix_view": "exact"},
                                  {f"{SETTINGS}routing.{which}": "cache_aware"}))  # fmt: skip
        return
    if r.strategy == "colocated":
        yield c.at("PD034", "info", "settings", "routing.prefix_view",
                   "prefix_view \"exact\" changes nothing under strategy \"colocated\": the workers get no "
                   "--kv-events-config", fixes=({f"{SETTINGS}routing.prefix_view": "approx"},))  # fmt: skip
        return
    far = sorted({w.host for w in c.dep.workers if not _loopback(w.host)})
    if far and _loopback(r.kv_events_host):
        yield c.at("PD034", "error", "settings", "routing.kv_events_host",
                   f"the workers on {', '.join(far)} publish their KV cache events to routing.kv_events_host "
                   f"({r.kv_events_host}), which they cannot reach: their views stay empty",
                   hint="or set kv_events_host to the gateway's address on the workers' network, and keep the port "
                   "unreachable from anyone else (docs/multi-node.md, The KV events port)",
                   fixes=({f"{SETTINGS}routing.prefix_view": "approx"},))  # fmt: skip
    if not r.reads_kv_events:
        yield c.at("PD034", "info", "settings", "routing.prefix_view",
                   "the workers publish their KV cache events to routing.kv_events_port, but under pd_mode "
                   "\"always\", without kv_aware or prefill_queue_tokens, this gateway does not read them (a second, "
                   "adaptive gateway over the same workers may, as scripts/ab-demo.sh --exact runs it)",
                   fixes=({f"{SETTINGS}routing.prefix_view": "approx"},
                          {f"{SETTINGS}routing.pd_mode": "adaptive"}))  # fmt: skip


#: The policies that learn from the requests they route (each gateway process from its own).
_LEARNING = ("cache_aware", "kv_aware")


def several_processes(c: Ctx) -> Iterable[Finding]:
    """PD038: a request-aware routing policy or the prefill queue in several gateway processes, each with its own
    view, load counts and queue."""
    r, n = c.dep.routing, c.dep.gateway.workers
    # The queue on the exact view matches by the engines' own events, which every process receives: measured with
    # two processes at 0.94x one's throughput (docs/performance.md, "The prefill queue"), so neither it nor the
    # prefill policy behind it is warned about.
    shared = r.prefill_queue_tokens is not None and r.prefix_view == "exact"
    which = [k for k in ("prefill_policy", "decode_policy")
             if getattr(r, k) in _LEARNING and not (shared and k == "prefill_policy")]  # fmt: skip
    queue = r.prefill_queue_tokens is not None and not shared
    if n <= 1 or not (which or queue) or r.strategy != "pd_disagg":
        return
    what = " and ".join([*(f"{k} = {getattr(r, k)!r}" for k in which), *(["prefill_queue_tokens"] if queue else [])])
    also = ", and each counts only its own requests against a prefill's room" if queue else ""
    measured = ' (docs/performance.md, "xPyD routing policies")' if which else ""
    fix: dict[str, object] = {f"{SETTINGS}routing.{k}": "least_loaded" for k in which}
    fixes: list[dict[str, object]] = [{f"{SETTINGS}gateway.workers": 1}, fix]
    if queue:
        fix[f"{SETTINGS}routing.prefill_queue_tokens"] = None
        if not which:  # on the exact view the processes share what the engines hold
            fixes.append({f"{SETTINGS}routing.prefix_view": "exact"})
    yield c.at("PD038", "warning", "settings", "gateway.workers",
               f"{what} with gateway.workers = {n}: each process learns only the requests it routes{also}, so the "
               f"{n} processes send one prefix to different instances{measured}", fixes=tuple(fixes))  # fmt: skip


def queue_view(c: Ctx) -> Iterable[Finding]:
    """PD039: ``routing.prefill_queue_tokens`` on the approximate view, left at its default size."""
    r = c.dep.routing
    if r.prefill_queue_tokens is None or r.strategy != "pd_disagg" or r.prefix_view == "exact":
        return
    if r.prefix_cache_blocks != RoutingConfig().prefix_cache_blocks:
        return  # sized to the engines' caches by hand
    yield c.at("PD039", "warning", "settings", "routing.prefill_queue_tokens",
               "the prefill queue binds a request to the prefill that holds its prefix, but the approximate view "
               "never forgets what a prefill computed while the engine evicts: requests wait for prefills that no "
               "longer hold them (docs/performance.md, \"The prefill queue\")",
               hint="the workers' own KV cache events; or size routing.prefix_cache_blocks to the engines' caches: "
               "num_gpu_blocks x block_size / 64",
               fixes=({f"{SETTINGS}routing.prefix_view": "exact"},))  # fmt: skip
