"""Rules about the gateway's keys and what its limits count.

- :func:`key_env` PD007: ``api_key_env`` / ``upstream_api_key_env`` holds a key instead of a variable's
  name; PD008: that variable is not set.
- :func:`shared_key` PD030: clients authenticate with the paid upstream key.
- :func:`keys_file` PD000: the keys file does not load as the gateway will load it.
- :func:`kv_events_keys` PD040: ``routing.kv_events_curve`` where no event travels, or without its CURVE keys in
  the environment (or with a malformed one).
- :func:`tokenizers` PD031: no local tokenizer, so the gateway's limits estimate prompt tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from pdctl.check.findings import SETTINGS, Action, Ctx, Finding, finding_from_error, is_local
from pdctl.errors import ConfigError

_KEY_LIKE = re.compile(r"^(sk-|sk_|pk-|tt-|Bearer\s)|^[A-Za-z0-9_\-]{24,}$")
_ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def key_env(c: Ctx) -> Iterable[Finding]:
    """PD007: the gateway's key settings name environment variables, not keys; PD008: those are set."""
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


def shared_key(c: Ctx) -> Iterable[Finding]:
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


def keys_file(c: Ctx) -> Iterable[Finding]:
    """The keys file loads as the gateway will load it (PD000 with its file, line and field otherwise)."""
    if c.dep.gateway.keys_file:
        from pdctl.gateway.keys import load_keys

        try:
            load_keys(Path(c.dep.gateway.keys_file), c.env, need_env=c.for_up)
        except ConfigError as exc:
            yield finding_from_error(exc)


def kv_events_keys(c: Ctx) -> Iterable[Finding]:
    """PD040: CURVE on the KV events port that changes nothing, or whose keys the gateway and relays would miss."""
    from pdctl.vllm.kv_curve import client_keys, server_keys

    r = c.dep.routing
    if not r.kv_events_curve:
        return
    if r.prefix_view != "exact" or r.strategy != "pd_disagg":
        yield c.at("PD040", "info", "settings", "routing.kv_events_curve",
                   "kv_events_curve changes nothing: no worker publishes KV cache events (they do with "
                   'prefix_view "exact" and strategy "pd_disagg")',
                   fixes=({f"{SETTINGS}routing.kv_events_curve": False},))  # fmt: skip
        return
    for load in (server_keys, client_keys):  # the gateway's side, then the relays'
        try:
            load(c.env)
        except ConfigError as exc:
            yield c.at("PD040", "error" if c.for_up else "warning", "settings", "routing.kv_events_curve",
                       f"{exc.key}: {exc.detail}: the {'gateway' if load is server_keys else 'relays'} cannot "
                       "start", exc.hint,
                       fixes=({f"{SETTINGS}routing.kv_events_curve": False},))  # fmt: skip
            return


def tokenizers(c: Ctx) -> Iterable[Finding]:
    """PD031: a model without a local tokenizer.json gets estimated token counts in the gateway's limits, and no
    exact view (a warning where the gateway reads the workers' KV events)."""
    from pdctl.gateway.tokens import find_tokenizer

    seen: set[str] = set()
    for w in c.dep.workers:
        if w.engine != "vllm" or w.model in seen:
            continue
        seen.add(w.model)
        source = c.dep.resolve_path(w.model) if is_local(w.model) else w.model
        if find_tokenizer(source) is None:
            exact = c.dep.routing.reads_kv_events
            also = (", and the exact view (routing.prefix_view) cannot hash its prompts: they are routed by the "
                    "approximate view") if exact else ""  # fmt: skip
            yield c.at("PD031", "warning" if exact else "info", "config", f"{w.table}.model",
                       f"no tokenizer.json for {w.model} on this machine: the gateway estimates prompt tokens "
                       f"(rate limits, admission) instead of counting them{also}",
                       f"download it (`hf download {w.model}`) or point `model` at its folder")  # fmt: skip
