"""Every `pdctl check` rule, once: its code, severity, title, the fix, and the doc section holding any measurement.

docs/config.md's table of lint rules is :func:`table`'s text (tests/check/test_rules.py holds them equal), and every
code a rule module reports is one of :data:`RULES` (the same test). A rule's text says what is wrong and how to fix
it; numbers behind a rule live in the doc section it names (``doc``), not in the rule.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RULES", "LintRule", "by_code", "table"]


@dataclass(frozen=True, slots=True)
class LintRule:
    """One rule of `pdctl check`."""

    code: str
    severity: str
    """As the table says it: ``error``, ``warning``, ``info``, or a pair (``warning (error for `up`)``)."""
    title: str
    """What is wrong."""
    fix: str = ""
    """How to fix it (empty where the title says it)."""
    doc: str = ""
    """The doc section holding the measurement behind the rule (``docs/FILE.md``, "Section")."""

    def row(self) -> str:
        """The rule's row in docs/config.md's table."""
        text = self.title + (f". The fix: {self.fix}" if self.fix else "") + (f" ({self.doc})" if self.doc else "")
        return f"| {self.code} | {self.severity} | {text} |"


# fmt: off
RULES: tuple[LintRule, ...] = (
    LintRule('PD000', 'error',
             'the file does not parse or a value is invalid'),
    LintRule('PD001', 'error',
             'connector differs between `[connector]`, a worker override and `routing.kv_connector` (recipe §5.1)'),
    LintRule('PD002', 'error/warning',
             '`backend` inconsistent with the connector; shared storage without a path'),
    LintRule('PD003', 'error',
             'connector unknown to the installed vLLM (read from its registry), renamed (`SharedStorageConnector` '
             '→ `ExampleConnector`) or removed (`P2pNcclConnector`); the fix names the new name, or the closest '
             'connector pdctl runs (else `NixlConnector`)'),
    LintRule('PD004', 'error',
             'prefill and decode load different models (§5.4)'),
    LintRule('PD005', 'error',
             'a local path on one side and a hub name on the other (§5.4)'),
    LintRule('PD006', 'warning (error for `up`)',
             'a local model folder does not exist; the way out: run `pdctl model tiny /absolute/folder` (a random '
             'test model), or point `model` at the weights (`hf download MODEL --local-dir FOLDER`)'),
    LintRule('PD007', 'error',
             '`api_key_env` holds something that looks like a key (§5.2)'),
    LintRule('PD008', 'warning (error for `up`)',
             "the key's environment variable is unset; the way out: `export NAME=<key>` in the shell that runs "
             'pdctl'),
    LintRule('PD009', 'error',
             '`gpu_memory_utilization` ≤ 0 or > 1'),
    LintRule('PD010', 'warning',
             'decode `gpu_memory_utilization` > 0.95 (§5.3; fix 0.9); > 0.5 on vLLM CPU (fix: 0.2 and '
             '`env.VLLM_CPU_KVCACHE_SPACE = "1"`, the KV cache in GiB)'),
    LintRule('PD011', 'warning',
             'prefill `max_num_batched_tokens` > 4096 with chunked prefill off (§5.3)'),
    LintRule('PD012', 'error',
             '`tensor_parallel_size` ≠ number of `gpu_ids`'),
    LintRule('PD013', 'warning',
             'prefill and decode share GPUs'),
    LintRule('PD014', 'warning (error for `up`: a core that does not exist)',
             'workers share CPU cores; a core that does not exist'),
    LintRule('PD015', 'warning (error for `up`)',
             '`kv_buffer_device = "cuda"` with the CPU build of vLLM; the fix: `"cpu"`, `cpu_ids` (a free core '
             'each) instead of `gpu_ids`'),
    LintRule('PD016', 'warning (error for `up`)',
             "vLLM is not installed for the engine's interpreter; the fixes: remove `[engine] python` when pdctl's"
             ' own interpreter has vLLM, or `engine = "sim"`; the hint names the install command'),
    LintRule('PD017', 'error',
             'two of gateway, worker HTTP and NIXL side-channel ports are the same; the fix moves the last one to '
             'a free port (`side_channel_port`, the `routing` endpoint or `gateway.listen` with `[cluster] '
             'gateway_port`)'),
    LintRule('PD018', 'warning (error for `up`)',
             'a port is already in use; the ways out: move to a free port (as PD017), or stop what listens there '
             "(`ss -ltnp 'sport = :PORT'` names it)"),
    LintRule('PD019', 'info',
             '`kv_role = "kv_both"` with NIXL: the plan uses kv_producer / kv_consumer'),
    LintRule('PD020', 'info',
             "what `granularity` does (nothing, for vLLM's connectors)"),
    LintRule('PD021', 'info',
             'what `timeout_ms` maps to'),
    LintRule('PD022', 'info',
             'the gateway listens on all interfaces; the fix binds 127.0.0.1'),
    LintRule('PD023', 'warning',
             'a connector pdctl does not know: treated as returning `kv_transfer_params`; the fix: '
             '`NixlConnector`; or keep it and see with `pdctl verify` whether KV moved'),
    LintRule('PD025', 'error/warning',
             'simulator: unknown `[sim] profile` or `kv_transfer.link`; a large `kv_scale` with a GPU-size profile'),
    LintRule('PD024', 'error/warning',
             'chunked prefill off and `max_num_batched_tokens` < `max_model_len` (the configured one, else the '
             "model's context length): vLLM refuses to start (`SchedulerConfig.verify_max_model_len`). The recipe "
             "as written hits it: 8192 < Qwen3-8B's 40960. A warning when the context length cannot be known"),
    LintRule('PD026', 'error',
             "`max_model_len` above the model's context length: vLLM refuses to start unless "
             "`VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` is in the worker's `env` or pdctl's environment"),
    LintRule('PD027', 'error/warning',
             'prefill and decode would report different identities (`max_model_len`, served model name, engine): '
             "the warm-up refuses them (`pdctl/vllm/identity.py`'s rule); or, with NIXL, different explicit "
             "`dtype`s (its handshake hash covers the dtype). A warning when one side's length comes from a model "
             'pdctl cannot read'),
    LintRule(
        'PD028', 'error (info when it cannot run)',
        "with vLLM installed, each worker's planned command line goes through vLLM's own parser and config "
        'classes (`make_arg_parser`, `validate_parsed_serve_args`, `AsyncEngineArgs.from_cli_args`, '
        "`SchedulerConfig`) in one child process, no GPU, no weights; `up` runs it too, for this host's vLLM "
        'workers, before anything starts: an unknown flag, a bad value, a `--kv-transfer-config` vLLM '
        'rejects, a scheduler limit, named by worker, flag and the key behind it',
        fix="drop the flag (and its value) from `extra_args`, or remove the key behind it (vLLM's default); "
            "`check --no-vllm-parse` and `up --no-vllm-parse` skip the check, whose time is vLLM's import",
        doc='docs/config.md, "What PD028 costs"',
    ),
    LintRule('PD030', 'warning',
             "an upstream is set and clients use the upstream's key itself (no `upstream_api_key_env`, no "
             '`keys_file`): every client holds the paid credential; the hint shows the two-line change'),
    LintRule('PD031', 'info / warning',
             "a vLLM worker's model has no `tokenizer.json` on this machine: the gateway estimates prompt tokens "
             "for rate limits and admission; a warning where the gateway reads the workers' KV events "
             '(`prefix_view = "exact"` with adaptive PD, `kv_aware` or the prefill queue): without the prompts\' '
             'token ids it routes by the approximate view'),
    LintRule('PD032', 'warning / info',
             "vLLM's tool calling (`--enable-auto-tool-choice --tool-call-parser NAME` in `extra_args`): a warning"
             ' when the vLLM workers disagree (prefill renders and validates the request, decode parses the calls:'
             " agents' requests then get 400 on one leg), an info when none has it while the gateway serves "
             '`/v1/responses` and `/v1/messages` (vLLM 0.32 answers tools with `tool_choice` `"auto"`, the default'
             ' of Responses and chat, with 400 \'"auto" tool choice requires --enable-auto-tool-choice and '
             '--tool-call-parser to be set\'; `"required"` or a named tool needs the parser too). The fix adds both'
             " flags to every worker, with the parser from the model's family (Qwen: `hermes`, Llama 3: "
             '`llama3_json`, Mistral: `mistral`) or its tokenizer (Hermes-style `<tool_call>` tokens: `hermes`, '
             'else `pythonic`, as for `pdctl model tiny`)'),
    LintRule('PD033', 'warning / info',
             '`routing.pd_mode = "adaptive"` whose thresholds send every request one way: '
             "`local_max_uncached_tokens = 0` (always both legs), or a threshold at least decode's `max_model_len`"
             ' with no share rule and no request cap (always decode alone); an info under `strategy = '
             '"colocated"`, where it changes nothing. The fix sets the threshold back to 512, or `pd_mode = '
             '"always"`'),
    LintRule('PD034', 'info, error',
             '`routing.prefix_view = "exact"` where this gateway does not use it: under `strategy = "colocated"` '
             '(no events) and under `pd_mode = "always"` with no `kv_aware` policy (the workers publish, this '
             'gateway does not read them; another, adaptive gateway over the same workers may). The fix sets '
             '`prefix_view = "approx"`, or `pd_mode = "adaptive"`. An error when `prefill_policy` or '
             '`decode_policy` is `kv_aware` with `prefix_view = "approx"` (no events to read; the gateway refuses '
             'to start): the fix sets `prefix_view = "exact"`, or the policy to `cache_aware`. An error too when a '
             'worker runs on another host and `routing.kv_events_host` is loopback (its events cannot reach the '
             'gateway)'),
    LintRule(
        'PD038', 'warning',
        '`routing.prefill_policy` or `decode_policy` = `cache_aware` or `kv_aware`, or '
        '`routing.prefill_queue_tokens`, with `gateway.workers` > 1: each gateway process learns only the '
        "requests it routes (and counts only its own against a prefill's room), so the processes send one "
        'prefix to different instances; not the queue on `prefix_view = "exact"`, nor the prefill policy '
        "behind it: every process receives the engines' events",
        fix='`gateway.workers = 1`, or the policy `least_loaded` (and no `prefill_queue_tokens`), or, when the '
            'queue alone is warned about, `prefix_view = "exact"`',
        doc='docs/performance.md, "xPyD routing policies"',
    ),
    LintRule(
        'PD039', 'warning',
        '`routing.prefill_queue_tokens` with `prefix_view = "approx"` and `prefix_cache_blocks` at its '
        'default: the approximate view never forgets what a prefill computed while the engine evicts, so the '
        'queue holds requests for prefills that no longer hold their prefix',
        fix='`prefix_view = "exact"`; sizing `prefix_cache_blocks` to the engines\' caches (`num_gpu_blocks × '
            'block_size / 64`) also silences it',
        doc='docs/performance.md, "The prefill queue"',
    ),
    LintRule('PD040', 'info, warning (error for `up`)',
             '`routing.kv_events_curve` where no worker publishes KV cache events (info), or with a CURVE key '
             'missing from the environment or malformed (`PDCTL_KV_EVENTS_SERVER_SECRET`, `_CLIENT_PUBLIC`, '
             '`_CLIENT_SECRET`, `_SERVER_PUBLIC`): the gateway or the relays cannot start',
             fix='`pdctl keys kv-events -o kv-events.env` and load it into the environment of `pdctl up`, or '
                 '`kv_events_curve = false`',
             doc='docs/multi-node.md, "The KV events port"'),
    LintRule('PD041', 'info, warning, error',
             '`slo.capacity_profile` that does not load (error: the gateway cannot start), profiles another '
             'model (warning: the advice would size that model), or under strategy `colocated` (info: the '
             'gateway advises P/D counts only)',
             fix='measure the deployment with `pdctl profile -o profile.json`',
             doc='docs/multi-node.md, "Advice from the gateway"'),
    LintRule('PD037', 'info',
             '`logging.trace_content` or `logging.collect_detailed_traces` without `logging.otlp_traces_endpoint`:'
             ' no spans are made to hold them. The fix removes the key'),
    LintRule('PD029', 'error',
             "a connector whose protocol pdctl's gateway does not speak (`MooncakeConnector`: vLLM 0.32's needs a "
             'router-minted `transfer_id` and `remote_bootstrap_addr`), or that moves no KV '
             '(`DecodeBenchConnector`: dummy KV on decode), refused instead of letting every request fall back'),
)
# fmt: on


def by_code(code: str) -> LintRule:
    """The rule of ``code`` (KeyError: no such rule)."""
    for rule in RULES:
        if rule.code == code:
            return rule
    raise KeyError(code)


def table() -> str:
    """docs/config.md's table of lint rules."""
    return "\n".join(
        ["| code | severity | rule |", "|---|---|---|", *(r.row() for r in sorted(RULES, key=lambda r: r.code))]
    )
