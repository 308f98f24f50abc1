"""Lint rules for a Deployment (``pdctl check``): every pitfall of the recipe caught before a GPU is touched.

Each rule has a stable code, a severity (``error`` blocks ``up``; ``warning`` and ``info`` do not), the
file, line and key it is about, and a fix hint. The way out is data, and the hint is written from it: an edit
of the files in ``Finding.fixes`` (alternatives of key -> value), a change to the machine in ``Finding.actions``
(export a variable, run a pdctl command, stop what holds a port). ``tests/check/test_check_fixes.py`` carries out each
one and starts the result on the simulator. Rules never raise; they return findings.

Where each rule lives, by topic (a rule is a function of :class:`~pdctl.check.findings.Ctx` that yields
findings; :data:`RULES` lists them once, in the order they run):

| module | codes | topic |
|---|---|---|
| `findings` | PD000 | ``Finding``, ``Action``, ``finding_from_error``, the rules' context |
| `connector` | PD001-PD003, PD019-PD023, PD029 | the KV connector, and what its settings map to |
| `engine` | PD004-PD006, PD024-PD028 | models, lengths, identity, the simulator, vLLM's own parser |
| `keys` | PD000 (keys file), PD007, PD008, PD030, PD031 | the gateway's keys, what its limits count |
| `memory` | PD009-PD016 | memory, GPUs, cores, the installed vLLM |
| `ports` | PD017, PD018 | ports, and ``port_findings`` / ``port_taken_error`` for ``up`` |
| `agents` | PD032 | vLLM's tool calling for the agent routes |
| `routing` | PD033, PD034, PD038 | adaptive PD's thresholds; the exact prefix view; learning policies per process |
| `tracing` | PD037 | span options without a collector |
| `keys_table` | | ``describe_key``: where each configuration key ends up |

Besides pdctl's own rules: the model's context length (:mod:`pdctl.vllm.modelinfo`) for what vLLM refuses at
start (PD024, PD026), the warm-up's identity rule (PD027), and, on request, the installed vLLM's own parser
over the planned command lines (PD028, :mod:`pdctl.vllm.args`; ``check`` and ``up`` ask for it).

Vocabulary: a lint result is a **finding** (:class:`Finding`, by severity), never a "check" (``verify``'s
word for a test of a running deployment) nor an "invariant" (the reliability tests'); docs/architecture.md.
"""

from __future__ import annotations

import os

from pdctl.check import agents, capacity, connector, engine, keys, memory, ports, routing, tracing
from pdctl.check.connector import known_connectors
from pdctl.check.findings import SETTINGS, Action, Ctx, Finding, Rule, Severity, finding_from_error
from pdctl.check.keys_table import KeyUse, describe_key
from pdctl.check.ports import port_findings, port_taken_error
from pdctl.config import Deployment
from pdctl.runtime.plan import VllmInstall, detect_vllm

__all__ = [
    "RULES",
    "SETTINGS",
    "Action",
    "Finding",
    "KeyUse",
    "Severity",
    "describe_key",
    "finding_from_error",
    "known_connectors",
    "port_findings",
    "port_taken_error",
    "run_checks",
]

#: Every rule, in the order they run; findings with the same severity, file and line come out in this order.
RULES: tuple[Rule, ...] = (
    connector.connectors, connector.backend, connector.connector_exists, engine.models, keys.key_env,
    keys.shared_key, keys.keys_file, keys.kv_events_keys, keys.tokenizers, memory.memory, engine.lengths,
    engine.identity, memory.devices, ports.ports, connector.mappings, agents.tools, routing.adaptive,
    routing.exact_view, routing.several_processes, routing.queue_view, engine.sim, tracing.without_collector,
    capacity.capacity_profile,
)  # fmt: skip


def run_checks(
    dep: Deployment,
    *,
    for_up: bool = False,
    vllm: VllmInstall | None = None,
    env: dict[str, str] | None = None,
    parse_with_vllm: bool = False,
) -> list[Finding]:
    """All findings for ``dep``; ``for_up`` makes environment problems (unset key, busy ports) errors.

    ``parse_with_vllm`` also runs the planned command lines through the installed vLLM's parser (PD028;
    a child process; its time is vLLM's import).
    """
    environ = dict(os.environ) if env is None else env
    contexts = {w.name: engine.context_of(dep, w, environ) for w in dep.workers}
    ctx = Ctx(dep, for_up, vllm or detect_vllm(dep.engine_python), environ, contexts)
    findings = [f for rule in RULES for f in rule(ctx)]
    if parse_with_vllm:
        findings += list(engine.vllm_refusals(ctx, findings))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: (order[f.severity], f.file, f.line or 0))
