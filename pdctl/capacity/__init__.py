"""Capacity planning: a deployment's measured profile (:mod:`.profile`), the sizing model that turns a profile, a
workload and an SLO into prefill and decode counts (:mod:`.model`), and the probes that measure a profile through
a running gateway (:mod:`.measure`). Nothing here prints; ``pdctl profile`` and ``pdctl advise`` (pdctl/cli) do."""
