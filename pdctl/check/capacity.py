"""Rules about the gateway's sizing advice (``slo.capacity_profile``).

- :func:`capacity_profile` PD041: the profile does not load as the gateway will load it (error: the gateway would
  not start), was measured on another model (warning: the advice would size that model), or the deployment is
  colocated (info: the advice sizes P/D deployments only).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pdctl.check.findings import SETTINGS, Ctx, Finding


def capacity_profile(c: Ctx) -> Iterable[Finding]:
    """PD041: a profile the gateway cannot use, or one of another model."""
    from pdctl.capacity.profile import ProfileError, load

    path = c.dep.slo.capacity_profile
    if not path:
        return
    key = "slo.capacity_profile"
    if c.dep.routing.strategy == "colocated":
        yield c.at("PD041", "info", "settings", key,
                   'capacity_profile changes nothing under strategy "colocated": the gateway advises prefill and '
                   "decode counts only; `pdctl advise` answers for colocated engines",
                   fixes=({f"{SETTINGS}{key}": None},))  # fmt: skip
        return
    try:
        profile = load(Path(path))
    except ProfileError as exc:
        yield c.at("PD041", "error", "settings", key, f"{exc}: the gateway cannot start with it",
                   exc.hint or "measure one with `pdctl profile -o profile.json` on this deployment")  # fmt: skip
        return
    models = {w.model_name for w in c.dep.workers} | {w.model for w in c.dep.workers}
    if profile.model not in models:
        yield c.at("PD041", "warning", "settings", key,
                   f"the profile was measured on {profile.model!r}, the workers serve {sorted(models)[0]!r}: the "
                   "advice would size the profiled model",
                   "measure this deployment with `pdctl profile -o profile.json`")  # fmt: skip
