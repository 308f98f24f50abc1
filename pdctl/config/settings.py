"""settings.json's objects: what the gateway runs from.

One frozen dataclass per object, each key declared on its field with :func:`~pdctl.config.schema.key`:
``gateway`` (:class:`GatewayConfig`, with its ``rate_limit`` sub-table :class:`RateLimitConfig`), ``routing``
(:class:`RoutingConfig`), ``slo`` (:class:`SLOConfig`) and ``logging`` (:class:`LoggingConfig`), together a
:class:`Settings`. :data:`SETTINGS_SECTIONS` names the objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pdctl.config.schema import (
    as_bool,
    as_choice,
    as_endpoints,
    as_http_url,
    as_int,
    as_listen,
    as_num,
    as_str,
    key,
    section,
)

Strategy = Literal["pd_disagg", "colocated"]
PdMode = Literal["always", "adaptive", "auto"]
PrefixView = Literal["approx", "exact"]
"""``routing.prefix_view``: what adaptive PD believes each worker holds: the blocks of the prompts the gateway sent
there, or the workers' own KV cache events (:mod:`pdctl.gateway.routing.exact_view`)."""
"""``routing.pd_mode``: every request takes both legs, or the gateway decides per request from what the chosen
decode already holds (:mod:`pdctl.gateway.routing.chooser`), or from the SLO and the learned costs of each path
(:mod:`pdctl.gateway.routing.autopilot`)."""
Policy = Literal["least_loaded", "power_of_two", "round_robin", "cache_aware", "kv_aware"]
"""``routing.prefill_policy`` / ``decode_policy``: how one pool's instance is chosen
(:mod:`pdctl.gateway.routing.policies`)."""
POLICIES: tuple[Policy, ...] = get_args(Policy)
Fallback = Literal["none", "decode", "upstream"]
"""``gateway.fallback``: no prefill can serve a PD request -> answer the error, let decode compute the prompt
itself, or send it to the upstream."""


#: ``routing.kv_events_max_blocks``: 1,048,576 blocks (16M tokens at block size 16; about 150 MB of view per worker).
DEFAULT_KV_EVENTS_MAX_BLOCKS = 1 << 20


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """``gateway.rate_limit`` (pdctl extension), and a key's own limits (:mod:`pdctl.gateway.keys`); None: unlimited."""

    # fmt: off
    requests_per_minute: int | None = key(
        None, as_int(1), "an integer >= 1", use="gateway", type="integer", default="none",
        doc="*extension*: 429 + Retry-After above it",
    )
    tokens_per_minute: int | None = key(
        None, as_int(1), "an integer >= 1", use="gateway", type="integer", default="none", doc="*extension*",
    )
    max_concurrency: int | None = key(
        None, as_int(1), "an integer >= 1", use="gateway", type="integer", default="none", doc="*extension*",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """``settings.json`` ``gateway``: the single entry point."""

    # fmt: off
    listen_host: str = key(
        "127.0.0.1", as_listen, '"host:port" with a port 1-65535', name="listen", into=("listen_host", "listen_port"),
        use="gateway", type='`"host:port"`', default='`"127.0.0.1:8000"`', doc="gateway bind address",
    )
    listen_port: int = 8000  # set with listen_host from the one key `listen` (its Key.into)
    upstream_base_url: str | None = key(
        None, as_http_url, "an http(s) URL", use="gateway", type="URL", default="none",
        doc="OpenAI-compatible API for models not served locally (docs/gateway.md)",
    )
    api_key_env: str = key(
        "PDCTL_API_KEY", as_str, "an environment variable name", use="gateway", type="env var name",
        doc="the variable holding the one key (never the key itself, PD007)",
    )
    upstream_api_key_env: str | None = key(
        None, as_str, "an environment variable name", use="gateway", type="env var name", default="`api_key_env`",
        doc="*extension*: a different key for the upstream (required with `keys_file` and an upstream; PD030 until "
        "set)",
    )
    request_timeout_s: float = key(
        120.0, as_num(0), "a number of seconds > 0", use="gateway", type="number", doc="overall deadline of a request",
    )
    max_retries: int = key(
        2, as_int(0, 10), "an integer 0-10", use="gateway", type="integer",
        doc="retries before the first byte reached the client: upstream calls, and PD pipelines (at most 3 there)",
    )
    max_body_bytes: int | None = key(
        None, as_int(1024), "an integer >= 1024", use="gateway", type="integer", default="none",
        doc="*extension*: larger bodies get 413, counted while reading; none: sized from the served models' largest "
        "`max_model_len` (32 bytes a token + 8 MiB, and 4 JSON values a token + 65,536; 32 MiB where a context "
        "length is unknown or with an upstream; docs/gateway.md)",
    )
    drain_timeout_s: float = key(
        30.0, as_num(-1), "a number of seconds >= 0", use="gateway", type="number",
        doc="*extension*: how long in-flight streams may finish on shutdown",
    )
    rate_limit: RateLimitConfig = section(RateLimitConfig)
    keys_file: str | None = key(
        None, as_str, "a path to a keys file (`pdctl keys add` makes one)", beside_file=True, use="gateway",
        type="path", default="none",
        doc="*extension*: per-user keys with their own limits (digests only; `pdctl keys add`); `$api_key_env` "
        "becomes optional (when set, the operator's key `default`); relative to settings.json",
    )
    tls_certfile: str | None = key(
        None, as_str, "a path to a PEM certificate", beside_file=True, use="gateway", type="path", default="none",
        doc="*extension*: PEM certificate, with `tls_keyfile` (both or neither): HTTPS only; checked at start "
        "(exists, not expired, key matches); relative to settings.json",
    )
    tls_keyfile: str | None = key(
        None, as_str, "a path to a PEM private key", beside_file=True, use="gateway", type="path", default="none",
        doc="*extension*: PEM private key of `tls_certfile`; relative to settings.json",
    )
    metrics_public: bool = key(
        False, as_bool, "true or false", use="gateway", type="bool",
        doc="*extension*: `/metrics` without a key even when `listen` is not loopback",
    )
    fallback: Fallback = key(
        "none", as_choice("none", "decode", "upstream"), "none, decode or upstream", use="gateway",
        type="`none` \\| `decode` \\| `upstream`",
        doc="*extension*: where a PD request goes when no prefill can serve it: the error, decode computing the "
        "prompt itself (`x-pd-path: fallback`), or the upstream",
    )
    workers: int = key(
        1, as_int(1, 64), "an integer 1-64", use="gateway", type="integer 1-64",
        doc="*extension*: gateway processes on the one port (SO_REUSEPORT); each enforces its share of every rate "
        "limit (docs/gateway.md, \"Several gateway processes\")",
    )
    max_header_bytes: int = key(
        60 * 1024, as_int(1024), "an integer >= 1024", use="gateway", type="integer", default="`61440` (60 KiB)",
        doc="*extension*: a larger request head (request line and headers) gets 431, counted as it arrives "
        "(Envoy's default)",
    )
    max_headers: int = key(
        100, as_int(1), "an integer >= 1", use="gateway", type="integer",
        doc="*extension*: a request with more header lines gets 431 (Envoy's default)",
    )
    header_timeout_s: float = key(
        60.0, as_num(0), "a number of seconds > 0", use="gateway", type="number",
        doc="*extension*: the request head must be complete this long after the connection opened or the head's "
        "first byte (408, or a close if nothing came; nginx's `client_header_timeout`)",
    )
    body_timeout_s: float = key(
        60.0, as_num(0), "a number of seconds > 0", use="gateway", type="number",
        doc="*extension*: the longest wait between two reads of a request body (408, or a close once the "
        "response started; nginx's `client_body_timeout`)",
    )
    max_connections: int = key(
        4096, as_int(1), "an integer >= 1", use="gateway", type="integer",
        doc="*extension*: client connections open at once, split between `workers`; above it 503 with "
        "`Retry-After`; lowered at start to what the file-descriptor limit allows (3 per connection)",
    )
    keepalive_timeout_s: float = key(
        30.0, as_num(0), "a number of seconds > 0", use="gateway", type="number",
        doc="*extension*: an idle keep-alive connection is closed after it",
    )
    migration_limit: int = key(
        3, as_int(0, 10), "an integer 0-10", use="gateway", type="integer",
        doc="*extension*: times a stream whose worker died after its first byte is continued elsewhere with the "
        "tokens sent so far (docs/reliability.md, \"Migration\"); 0: it ends with an error event",
    )
    stall_timeout_s: float = key(
        30.0, as_num(0), "a number of seconds > 0", use="gateway", type="number",
        doc="*extension*: a streaming worker that sends nothing for this long after its first byte is taken for "
        "hung (a token deadline): the stream migrates, or ends with an error event; before the first byte, and "
        "above it, `request_timeout_s` bounds each wait",
    )
    # fmt: on

    @property
    def url(self) -> str:
        """The URL a local client uses to reach the gateway."""
        host = "127.0.0.1" if self.listen_host in ("0.0.0.0", "", "::") else self.listen_host
        return f"{'https' if self.tls_certfile else 'http'}://{host}:{self.listen_port}"


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """``settings.json`` ``routing``."""

    # fmt: off
    prefill_endpoints: tuple[str, ...] = key(
        ("http://127.0.0.1:8100",), as_endpoints, "an http URL or a list of them", name="prefill_endpoint",
        use="gateway", type="URL or list of URLs", default='`"http://127.0.0.1:8100"`',
        doc="prefill instances (their `--port`)",
    )
    decode_endpoints: tuple[str, ...] = key(
        ("http://127.0.0.1:8200",), as_endpoints, "an http URL or a list of them", name="decode_endpoint",
        use="gateway", type="URL or list of URLs", default='`"http://127.0.0.1:8200"`', doc="decode instances",
    )
    strategy: Strategy = key(
        "pd_disagg", as_choice("pd_disagg", "colocated"), "pd_disagg or colocated", use="gateway",
        type="`pd_disagg` \\| `colocated`", doc="two legs P→D, or whole requests to one worker (A/B)",
    )
    kv_connector: str | None = key(
        None, as_str, "a connector name", use="gateway", type="string", default="`[connector]`",
        doc="must equal config.toml's connector (PD001)",
    )
    pd_mode: PdMode = key(
        "always", as_choice("always", "adaptive", "auto"), "always, adaptive or auto", use="gateway",
        type="`always` \\| `adaptive` \\| `auto`",
        doc="*extension*: `adaptive` serves a request on the chosen decode alone (no prefill leg, `x-pd-path: local`) "
        "when little of its prompt is uncached there (docs/gateway.md, Adaptive PD); `auto` predicts each path's "
        "TTFT and TPOT from learned costs and takes the one that meets `slo.ttft_ms` / `slo.tpot_ms` with least "
        "(decode alone, the whole request on a prefill engine, or both legs; docs/gateway.md, The SLO autopilot)",
    )
    local_max_uncached_tokens: int = key(
        512, as_int(0), "an integer >= 0", use="gateway", type="integer",
        doc="*extension*, `adaptive`: at most this many prompt tokens not yet cached on the decode go local",
    )
    local_max_uncached_share: float = key(
        1.0, as_num(0.0, 1.0), "a number in (0, 1]", use="gateway", type="number",
        doc="*extension*, `adaptive`: and at most this share of the prompt uncached (1: no share rule)",
    )
    local_max_decode_requests: int | None = key(
        None, as_int(1), "an integer >= 1", use="gateway", type="integer", default="none",
        doc="*extension*, `adaptive`: no local prefill on a decode with this many requests in flight",
    )
    prefix_cache_blocks: int = key(
        31250, as_int(1), "an integer >= 1", use="gateway", type="integer",
        doc="*extension*, `adaptive`: blocks (about 64 tokens each) the gateway remembers per instance",
    )
    local_max_stall_ms: float | None = key(
        None, as_num(0.0), "a number >= 0", use="gateway", type="number", default="none",
        doc="*extension*, `adaptive`: no local prefill on a decode with streams in flight when it would stall them "
        "longer than this (uncached tokens x the prefill seconds per token the gateway measures); e.g. `slo.tpot_ms`",
    )
    prefix_view: PrefixView = key(
        "approx", as_choice("approx", "exact"), "approx or exact", use="gateway", type="`approx` \\| `exact`",
        doc="*extension*, `adaptive`, `kv_aware` and the prefill queue: `exact` follows each worker's vLLM KV cache "
        "events (the plan adds `--kv-events-config`) and hashes the prompt's token ids; `approx` remembers what the "
        "gateway sent",
    )
    kv_events_port: int = key(
        5557, as_int(1, 65535), "a port number", use="gateway", type="integer",
        doc="*extension*, `prefix_view = \"exact\"`: the port the gateway binds for the workers' KV cache events",
    )
    kv_events_host: str = key(
        "127.0.0.1", as_str, "a host address", use="gateway", type="host",
        doc="*extension*, `prefix_view = \"exact\"`: the address the gateway binds for the workers' KV cache events "
        "and the workers dial; loopback unless workers on other hosts publish (the port is unauthenticated: "
        "docs/multi-node.md, The KV events port); `pdctl render k8s` sets `0.0.0.0` behind a NetworkPolicy",
    )
    kv_events_curve: bool = key(
        False, as_bool, "true or false", use="gateway", type="bool",
        doc="*extension*, `prefix_view = \"exact\"`: the events travel to the gateway over ZMQ CURVE (encrypted, "
        "and only the deployment's key admitted), through one `pdctl kv-relay` next to each worker; keys from "
        "the environment only (`pdctl keys kv-events`; docs/multi-node.md, The KV events port)",
    )
    kv_events_max_blocks: int = key(
        DEFAULT_KV_EVENTS_MAX_BLOCKS, as_int(1), "an integer >= 1", use="gateway", type="integer",
        doc="*extension*, `prefix_view = \"exact\"`: blocks the gateway keeps per worker from its events, at most; "
        "lower where the worker reports its KV cache (twice `num_gpu_blocks` + `num_cpu_blocks` of "
        "`vllm:cache_config_info`); a worker's events that claim more empty its view",
    )
    prefill_policy: Policy = key(
        "least_loaded", as_choice(*POLICIES), "one of " + ", ".join(POLICIES), use="gateway",
        type="`least_loaded` \\| `power_of_two` \\| `round_robin` \\| `cache_aware` \\| `kv_aware`",
        doc="*extension*: how the prefill of a request is chosen (docs/gateway.md, Routing policies); `kv_aware` "
        "needs `prefix_view = \"exact\"` (PD034)",
    )
    decode_policy: Policy = key(
        "least_loaded", as_choice(*POLICIES), "one of " + ", ".join(POLICIES), use="gateway",
        type="`least_loaded` \\| `power_of_two` \\| `round_robin` \\| `cache_aware` \\| `kv_aware`",
        doc="*extension*: how the decode of a request is chosen, as `prefill_policy`",
    )
    cache_threshold: float = key(
        0.3, as_num(0.0, 1.0), "a number in (0, 1]", use="gateway", type="number",
        doc="*extension*, `cache_aware`: the best match must hold more than this share of the prompt, else the "
        "instance with the smallest prefix view",
    )
    balance_abs_threshold: int = key(
        64, as_int(0), "an integer >= 0", use="gateway", type="integer",
        doc="*extension*, `cache_aware` and adaptive PD: a pool is imbalanced (the least loaded instance wins) when "
        "its busiest and idlest instance differ by more than this many requests in flight ...",
    )
    balance_rel_threshold: float = key(
        1.5, as_num(0.0), "a number > 0", use="gateway", type="number",
        doc="*extension*, `cache_aware` and adaptive PD: ... and the busiest has more than this many times the "
        "idlest's",
    )
    kv_overlap_credit: float = key(
        1.0, as_num(0.0), "a number > 0", use="gateway", type="number",
        doc="*extension*, `kv_aware`: each cached block of the prompt takes this many blocks off an instance's cost "
        "(Dynamo's `--router-kv-overlap-score-credit`, default 1); above 1 a prefix stays with its holder against a "
        "longer queue",
    )
    prefill_queue_tokens: int | None = key(
        None, as_int(1), "an integer >= 1", use="gateway", type="integer", default="none",
        doc="*extension*: requests wait in the gateway while every prefill has this many uncached prompt tokens to "
        "compute, and a prefill with room takes the waiting request it holds most of (docs/gateway.md, The prefill "
        "queue); none: a request's prefill is chosen when it arrives",
    )
    # fmt: on

    @property
    def policies(self) -> tuple[Policy, Policy]:
        """``(prefill_policy, decode_policy)``."""
        return self.prefill_policy, self.decode_policy

    @property
    def routes_by_request(self) -> bool:
        """Whether the gateway builds a per-request routing decision (:class:`pdctl.gateway.routing.chooser.Chooser`):
        adaptive PD, a policy other than ``least_loaded`` on the two legs, or the prefill queue."""
        return self.strategy == "pd_disagg" and (
            self.pd_mode != "always"
            or any(p != "least_loaded" for p in self.policies)
            or self.prefill_queue_tokens is not None
        )

    @property
    def reads_kv_events(self) -> bool:
        """Whether the gateway reads its workers' KV cache events: the exact view with adaptive PD, ``kv_aware`` or
        the prefill queue."""
        return (
            self.prefix_view == "exact" and self.strategy == "pd_disagg"
            and (self.pd_mode != "always" or "kv_aware" in self.policies or self.prefill_queue_tokens is not None)
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class SLOConfig:
    """``settings.json`` ``slo``: targets, and the gateway's early rejection."""

    # fmt: off
    ttft_ms: float = key(
        400.0, as_num(0), "a number of milliseconds > 0", use="gateway", type="number > 0",
        doc="time-to-first-token target",
    )
    tpot_ms: float = key(
        40.0, as_num(0), "a number of milliseconds > 0", use="gateway", type="number > 0",
        doc="time-per-output-token target",
    )
    p90: bool = key(
        True, as_bool, "true or false", use="gateway", type="bool",
        doc="targets apply to the 90th percentile (bench goodput)",
    )
    admission: bool = key(
        True, as_bool, "true or false", use="gateway", type="bool",
        doc="*extension*: early rejection when the prediction misses the SLO",
    )
    overflow: Literal["reject", "upstream"] = key(
        "reject", as_choice("reject", "upstream"), "reject or upstream", use="gateway",
        type="`reject` \\| `upstream`", doc="*extension*: send would-miss requests upstream instead of 503",
    )
    capacity_profile: str | None = key(
        None, as_str, "a path to a `pdctl profile` file", beside_file=True, use="gateway", type="path",
        default="none",
        doc="*extension*: this deployment's `pdctl profile`; with it the gateway recommends prefill and decode counts "
        "for the last `advise_window_s` of its traffic (`pdctl_advice_*` metrics, `pdctl top`, the rendered "
        "monitoring's alerts; docs/multi-node.md, \"Advice from the gateway\"); relative to settings.json",
    )
    advise_window_s: float = key(
        300.0, as_num(0), "a number of seconds > 0", use="gateway", type="number",
        doc="*extension*: with `capacity_profile`: the window of finished requests the advice sizes for",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """``settings.json`` ``logging``."""

    # fmt: off
    level: Literal["debug", "info", "warning", "error"] = key(
        "info", as_choice("debug", "info", "warning", "error"), "one of debug, info, warning, error", use="gateway",
        type="`debug` \\| `info` \\| `warning` \\| `error`",
        doc="gateway log level, and the workers' (`VLLM_LOGGING_LEVEL`, set when not `info`)",
    )
    log_kv_transfer: bool = key(
        True, as_bool, "true or false", use="gateway", type="bool",
        doc="the gateway logs each KV handoff (engine id, blocks, remote host:port); below `debug`, the workers' KV "
        "loggers (`vllm.distributed.kv_transfer`: every connector; `vllm.v1.core.sched.scheduler`: \"Finished "
        "sending/recving KV transfer for request …\") run at DEBUG while the rest of vLLM stays at `level`, "
        "through a logging config pdctl writes to `<run_dir>/vllm-logging.json` and names in "
        "`VLLM_LOGGING_CONFIG_PATH` (vLLM 0.32's default config plus those two loggers), so `pdctl logs --kv` and "
        "verify's `kv_logs` see per-request KV lines",
    )
    otlp_traces_endpoint: str | None = key(
        None, as_http_url, "an http(s) URL (an OTLP/HTTP traces endpoint)", use="gateway", type="URL",
        default="none",
        doc="an OpenTelemetry collector's OTLP/HTTP traces URL (`http://collector:4318/v1/traces`): the gateway "
        "exports a span per request and per worker call there and sends each worker call's `traceparent`; vLLM "
        "workers get `--otlp-traces-endpoint` (and `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf`), so their "
        "spans join the trace. Unset: a client's `traceparent`/`tracestate` are passed to the workers unchanged "
        "(docs/observability.md)",
    )
    trace_content: bool = key(
        False, as_bool, "true or false", use="gateway", type="bool",
        doc="with `otlp_traces_endpoint` set: the gateway's server span also holds the request's prompt "
        "(`gen_ai.input.messages`) and the answer's text (`gen_ai.output.messages`), as OpenTelemetry's GenAI "
        "conventions name them; off by default, since prompts and answers are user data (docs/observability.md)",
    )
    collect_detailed_traces: Literal["model", "worker", "all"] | None = key(
        None, as_choice("model", "worker", "all"), "one of model, worker, all", use="gateway",
        type="`model` \\| `worker` \\| `all`", default="none",
        doc="with `otlp_traces_endpoint` set: vLLM workers get `--collect-detailed-traces` with this value, and "
        "their spans add model forward/execute times (vLLM warns that it costs throughput)",
    )
    # fmt: on


@dataclass(frozen=True, slots=True)
class Settings:
    """``settings.json``: what the gateway runs from (:func:`.load_settings`; a :class:`.Deployment` has the same)."""

    gateway: GatewayConfig
    routing: RoutingConfig
    slo: SLOConfig
    logging: LoggingConfig


#: settings.json's objects, each with the dataclass declaring its keys (the fields of :class:`Settings`).
SETTINGS_SECTIONS: dict[str, type] = {
    "gateway": GatewayConfig,
    "routing": RoutingConfig,
    "slo": SLOConfig,
    "logging": LoggingConfig,
}
