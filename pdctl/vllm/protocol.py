"""The one definition of vLLM's prefill/decode two-leg protocol.

Shared by everything that speaks it: the gateway, ``up``'s warm-up probe, ``verify``, and the
simulator's server side. See ``docs/gateway.md`` and vLLM's ``toy_proxy_server.py``.

Leg 1 (prefill): the client's body capped at one output token by the route's own field (:func:`cap_output`:
``max_tokens`` for chat, completions and Anthropic messages, ``max_output_tokens`` plus ``store``/``background``
false for Responses, where ``max_tokens`` is not a field), ``n = 1``, ``stream = false``, ``stream_options`` and
``min_tokens`` removed, and ``kv_transfer_params = {"do_remote_decode": true, ...}``.
Leg 2 (decode): the client's original body plus the ``kv_transfer_params`` the prefill returned, verbatim.
Shared-storage connectors return no params: leg 2 is the same prompt and decode finds the KV on disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "BILLING_HEADER",
    "COUNT_TOKENS_PATH",
    "MESSAGES_PATH",
    "NIXL_CONNECTORS",
    "PARAMS_CONNECTORS",
    "REQUIRED_DECODE_FIELDS",
    "RESPONSES_PATH",
    "UNSUPPORTED_CONNECTORS",
    "ConnectorKind",
    "KVParamsCheck",
    "build_decode_body",
    "build_prefill_body",
    "cap_output",
    "check_kv_params",
    "connector_kind",
]

ConnectorKind = Literal["params", "shared_storage", "unknown"]

#: NIXL's connectors (vLLM 0.32 ``kv_connector/v1/nixl``): NixlConnector is NixlPullConnector (decode reads);
#: NixlPushConnector has prefill write into blocks decode registers. Both answer leg 1 with the same
#: kv_transfer_params, hold the blocks for ``kv_lease_duration`` and use the side channel
#: (``VLLM_NIXL_SIDE_CHANNEL_PORT`` / ``_HOST``).
NIXL_CONNECTORS = frozenset({"NixlConnector", "NixlPullConnector", "NixlPushConnector"})
# Connectors whose prefill reply carries kv_transfer_params that decode must receive.
PARAMS_CONNECTORS = NIXL_CONNECTORS | {"MultiConnector", "LMCacheConnectorV1"}
SHARED_STORAGE_CONNECTORS = frozenset({"ExampleConnector", "SharedStorageConnector"})
#: Connectors whose protocol the two legs above do not speak, and why; ``check`` refuses them (PD029) rather
#: than let every request fall back to decode recomputing the prompt.
UNSUPPORTED_CONNECTORS: Mapping[str, str] = {
    "MooncakeConnector": (
        "vLLM 0.32's MooncakeConnector needs the router to mint a transfer_id for both legs and to send decode "
        "the prefill's remote_bootstrap_addr (mooncake_connector.py); pdctl's gateway sends NIXL's parameters, "
        "so decode would recompute every prompt"
    ),
    "DecodeBenchConnector": (
        "vLLM's DecodeBenchConnector fills decode's KV cache with dummy values to benchmark decode alone "
        "(decode_bench_connector.py); no KV moves from prefill and the output is not the model's"
    ),
}

# Without these decode logs "Got invalid KVTransferParams" and silently recomputes the prompt.
REQUIRED_DECODE_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")

PREFILL_REQUEST_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def connector_kind(connector: str | None) -> ConnectorKind:
    """How the gateway must run the legs for ``connector``."""
    if connector in PARAMS_CONNECTORS:
        return "params"
    if connector in SHARED_STORAGE_CONNECTORS:
        return "shared_storage"
    return "unknown"


RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
#: Claude Code's per-request attribution line, a system block vLLM 0.32 drops before rendering (its ``cch=`` value
#: changes every request: anthropics/claude-code#40652); ``vllm/renderers/chat_utils.py``'s
#: ``_CLAUDE_CODE_BILLING_HEADER``.
BILLING_HEADER = "x-anthropic-billing-header"
"""vLLM 0.32's Anthropic token count: a Messages body in, ``{"input_tokens": N, ...}`` out."""


def cap_output(body: dict[str, Any], endpoint: str) -> None:
    """Cap ``body`` (in place) at one output token, not streamed, with the field ``endpoint``'s vLLM request class
    reads (vllm-agent-apis.md §2); used by leg 1 and by the gateway's release leg."""
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        body.pop(name, None)
    body["stream"] = False
    if endpoint == RESPONSES_PATH:
        body["max_output_tokens"] = 1
        body["store"] = False
        body["background"] = False
        return
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    choice = body.get("tool_choice")
    if endpoint == MESSAGES_PATH and isinstance(choice, Mapping) and choice.get("type") in ("tool", "any"):
        # A forced tool makes the one-token answer a cut-off JSON object, which vLLM 0.32's non-streamed
        # Anthropic reply json.loads (messages_full_converter): a 400 for every such prefill. "none" keeps the
        # tools in the rendered prompt (unless vLLM runs with --exclude-tools-when-tool-choice-none), so the
        # prefilled KV is the prompt decode renders.
        body["tool_choice"] = {"type": "none"}


def build_prefill_body(
    body: Mapping[str, Any], kind: ConnectorKind = "params", endpoint: str = "/v1/chat/completions"
) -> dict[str, Any]:
    """Leg 1: the body sent to a prefill instance for ``endpoint`` (a new dict; ``body`` is not changed).

    ``n`` becomes 1: the prompt's KV is the same for every choice, and decode makes the client's ``n``.
    """
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    cap_output(out, endpoint)
    if "n" in out:
        out["n"] = 1
    out.pop("best_of", None)
    if kind != "shared_storage":
        out["kv_transfer_params"] = dict(PREFILL_REQUEST_PARAMS)
    return out


def build_decode_body(body: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """Leg 2: the client's original body plus prefill's ``kv_transfer_params`` verbatim."""
    out = dict(body)
    out.pop("kv_transfer_params", None)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = dict(kv_transfer_params)
    return out


@dataclass(frozen=True, slots=True)
class KVParamsCheck:
    """Whether a prefill reply's ``kv_transfer_params`` is usable by decode, and why not."""

    usable: bool
    reason: str  # "ok", "missing", "not_an_object", "missing_fields", "not_remote_prefill"
    params: Mapping[str, Any] | None
    missing: tuple[str, ...] = ()


def check_kv_params(prefill_reply: Mapping[str, Any]) -> KVParamsCheck:
    """Read the top-level ``kv_transfer_params`` of a prefill reply and say whether decode can use it."""
    params = prefill_reply.get("kv_transfer_params")
    if params is None:
        return KVParamsCheck(False, "missing", None)
    if not isinstance(params, Mapping):
        return KVParamsCheck(False, "not_an_object", None)
    missing = tuple(f for f in REQUIRED_DECODE_FIELDS if params.get(f) in (None, "", []))
    if missing:
        return KVParamsCheck(False, "missing_fields", params, missing)
    if params.get("do_remote_prefill") is not True:
        return KVParamsCheck(False, "not_remote_prefill", params)
    return KVParamsCheck(True, "ok", params)
