"""Routing: which instance takes each request. :class:`Router` is the one API the request paths call.

Map (each module one concept; the arrows are imports, one way):

- :mod:`~pdctl.gateway.routing.router`: :class:`Router`, the facade: a request's plan, leg 1's prefill (through the
  prefill queue, with a deadline), leg 2's decode, a retried prefill, a migration's target, a release leg's
  target, the load ahead for admission.
- :mod:`~pdctl.gateway.routing.pool`: the instances, their membership, health and breakers; chooses nothing.
- :mod:`~pdctl.gateway.routing.policies`: the per-pool policies, pure functions of candidates and scores.
- :mod:`~pdctl.gateway.routing.chooser`: applies the policies, keeps the per-instance prefix views and makes a
  request's plan.
- :mod:`~pdctl.gateway.routing.plan`: the plan of one request (:class:`RoutePlan`) and the local-or-disaggregated
  rule.
- :mod:`~pdctl.gateway.routing.approx_view`: prompt text, block hashing, the approximate view (the gateway's own
  traffic); :mod:`~pdctl.gateway.routing.exact_view`: the exact view (the engines' KV events);
  :mod:`~pdctl.gateway.routing.kv_events`: the events' subscriber and the relay to a multi-process gateway.
- :mod:`~pdctl.gateway.routing.prefill_queue`: leg 1 bound late, to the prefill that holds the prompt.
- :mod:`~pdctl.gateway.routing.autopilot` and :mod:`~pdctl.gateway.routing.costs`: the SLO autopilot's path
  choice and its learned cost model.
"""

from pdctl.gateway.routing.autopilot import Choice
from pdctl.gateway.routing.plan import RoutePlan
from pdctl.gateway.routing.pool import Instance, Pool, Role
from pdctl.gateway.routing.router import Router

__all__ = ["Choice", "Instance", "Pool", "Role", "RoutePlan", "Router"]
