from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from pdctl import config
from pdctl.config import load
from pdctl.errors import ConfigError
from pdctl.gateway.settings import from_settings
from tests.conftest import RECIPE, REPO

SEED = REPO.parent / "shared" / "seed"  # the project's copy of the article, beside the checkout in CI


def test_recipe_files_load_unchanged() -> None:
    dep = load(RECIPE / "config.toml", RECIPE / "settings.json")
    assert [w.name for w in dep.workers] == ["prefill", "decode"]
    p, d = dep.prefill[0], dep.decode[0]
    assert (p.model, p.gpu_ids, p.max_num_batched_tokens, p.max_num_seqs, p.enable_chunked_prefill) == (
        "Qwen/Qwen3-8B",
        (0,),
        8192,
        8,
        False,
    )
    assert (d.gpu_ids, d.max_num_seqs, d.gpu_memory_utilization) == ((1,), 64, 0.9)
    assert (p.port, d.port) == (8100, 8200)
    assert (dep.gateway.listen_host, dep.gateway.listen_port) == ("0.0.0.0", 8000)
    assert dep.gateway.api_key_env == "TAOTOKEN_API_KEY"
    assert dep.slo.ttft_ms == 400 and dep.slo.tpot_ms == 40 and dep.slo.p90
    assert dep.connector.kv_role == "kv_both"


@pytest.mark.skipif(not SEED.is_dir(), reason="shared/seed is not beside this checkout")
def test_recipe_fixture_is_the_seed_verbatim() -> None:
    for name in ("config.toml", "settings.json"):
        assert (RECIPE / name).read_bytes() == (SEED / name).read_bytes()


def test_init_templates_are_the_recipe_plus_max_model_len_only() -> None:
    """`pdctl init` writes the recipe's values; it only adds max_model_len (with a comment) on both workers."""
    data = REPO / "pdctl" / "data"
    assert (data / "settings.json").read_bytes() == (RECIPE / "settings.json").read_bytes()
    diff = list(
        difflib.ndiff(
            (RECIPE / "config.toml").read_text().splitlines(), (data / "config.toml").read_text().splitlines()
        )
    )
    assert not [d for d in diff if d.startswith("- ")]
    added = [d[2:] for d in diff if d.startswith("+ ")]
    assert [a for a in added if not a.startswith("#")] == ["max_model_len = 8192", "max_model_len = 8192"]
    for name in ("config.toml", "settings.json"):  # the GPU example is what init writes
        assert (REPO / "examples" / "gpu-2gpu" / name).read_bytes() == (data / name).read_bytes()


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        (
            {"max_num_seqs = 8\n": 'max_num_seqs = "8a"\n'},
            'config.toml:22: prefill.max_num_seqs: expected an integer >= 1, got "8a"',
        ),
        (
            {"max_num_seqs = 64": "max_num_seqs = 0"},
            "config.toml:33: decode.max_num_seqs: expected an integer >= 1, got 0",
        ),
        ({"max_num_seqs = 8\n": "max_num_seq = 8\n"}, "config.toml:22: prefill.max_num_seq: unknown key"),
        (
            {'granularity = "layer"': 'granularity = "tensor"'},
            'config.toml:12: kv_transfer.granularity: expected one of request, layer, block, got "tensor"',
        ),
        (
            {'role = "decode"': 'role = "prefill"'},
            "config.toml:28: decode.role: expected 'decode' in the [decode] table, got 'prefill'",
        ),
        (
            {"gpu_ids = [1]": "gpu_ids = [-1]"},
            "config.toml:30: decode.gpu_ids: expected a list of GPU indices, got [-1]",
        ),
        ({"[connector]": "[conector]"}, "config.toml:38: conector: unknown key"),
    ],
)
def test_config_errors_name_file_line_key(recipe_files, edits: dict[str, str], expected: str) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(config_edits=edits)
    with pytest.raises(ConfigError) as info:
        load(cpath, spath)
    assert str(info.value) == expected


@pytest.mark.parametrize(
    ("append", "expected", "hint"),
    [
        ("[supervisor]\nready_timeout = 60\n", "config.toml:46: supervisor.ready_timeout: unknown key",
         "did you mean 'ready_timeout_s'?"),
        ('[supervisor]\nrestart = "always"\n',
         'config.toml:46: supervisor.restart: expected never or on-failure, got "always"', None),
        ("[sim]\nkv_scale = 2\n", "config.toml:46: sim.kv_scale: expected a number in (0, 1], got 2", None),
        ("[engine]\npyhton = \"/usr/bin/python3\"\n", "config.toml:46: engine.pyhton: unknown key",
         "did you mean 'python'?"),
    ],
)  # fmt: skip
def test_section_errors_name_file_line_key(recipe_files, append: str, expected: str, hint: str | None) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(config_append="\n" + append)
    with pytest.raises(ConfigError) as info:
        load(cpath, spath)
    assert (str(info.value), info.value.hint) == (expected, hint)


def test_unknown_key_suggests_the_nearest(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(config_edits={"max_num_seqs = 8\n": "max_num_seq = 8\n"})
    with pytest.raises(ConfigError) as info:
        load(cpath, spath)
    assert info.value.hint == "did you mean 'max_num_seqs'?"


@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        (
            {'"listen": "0.0.0.0:8000"': '"listen": "0.0.0.0"'},
            'settings.json:3: gateway.listen: expected "host:port" with a port 1-65535, got "0.0.0.0"',
        ),
        (
            {'"ttft_ms": 400': '"ttft_ms": -5'},
            "settings.json:16: slo.ttft_ms: expected a number of milliseconds > 0, got -5",
        ),
        (
            {'"upstream_base_url": "https://taotoken.net/api"': '"upstream_base_url": "taotoken.net"'},
            'settings.json:4: gateway.upstream_base_url: expected an http(s) URL, got "taotoken.net"',
        ),
        (
            {'"strategy": "pd_disagg"': '"strategy": "pd"'},
            'settings.json:12: routing.strategy: expected pd_disagg or colocated, got "pd"',
        ),
        ({'"max_retries": 2': '"max_retrys": 2'}, "settings.json:7: gateway.max_retrys: unknown key"),
        (
            {'"max_retries": 2\n': '"max_retries": 2,\n    "rate_limit": {"max_concurrency": 0}\n'},
            "settings.json:8: gateway.rate_limit.max_concurrency: expected an integer >= 1, got 0",
        ),
        (
            {'"max_retries": 2\n': '"max_retries": 2,\n    "rate_limit": {"max_concurency": 1}\n'},
            "settings.json:8: gateway.rate_limit.max_concurency: unknown key",
        ),
        (
            {'"max_retries": 2\n': '"max_retries": 2,\n    "fallback": "prefill"\n'},
            'settings.json:8: gateway.fallback: expected none, decode or upstream, got "prefill"',
        ),
        (
            {'"listen": "0.0.0.0:8000"': '"listen": "0.0.0.0:9000"'},
            "config.toml:6: cluster.gateway_port: 0.0.0.0:8000 disagrees with gateway.listen 0.0.0.0:9000 in settings.json",
        ),
    ],
)
def test_settings_errors(recipe_files, edits: dict[str, str], expected: str) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(settings_edits=edits)
    with pytest.raises(ConfigError) as info:
        load(cpath, spath)
    assert str(info.value) == expected


def test_every_declared_gateway_key_is_read(tmp_path: Path) -> None:
    """A settings.json setting each key `config.GatewayConfig` declares loads into the field the key names."""
    (tmp_path / "certs").mkdir()
    gateway = {
        "listen": "0.0.0.0:9001",
        "upstream_base_url": "https://api.example.com/v1/",
        "api_key_env": "MY_KEY",
        "upstream_api_key_env": "UP_KEY",
        "request_timeout_s": 5,
        "max_retries": 0,
        "max_body_bytes": 2048,
        "drain_timeout_s": 0,
        "rate_limit": {"requests_per_minute": 60, "tokens_per_minute": 1000, "max_concurrency": 4},
        "keys_file": "keys.json",
        "tls_certfile": "certs/cert.pem",
        "tls_keyfile": "/abs/key.pem",
        "metrics_public": True,
        "fallback": "decode",
        "workers": 3,
        "max_header_bytes": 4096,
        "max_headers": 20,
        "header_timeout_s": 3,
        "body_timeout_s": 4,
        "max_connections": 10,
        "keepalive_timeout_s": 7.5,
        "migration_limit": 0,
        "stall_timeout_s": 12.5,
    }
    set_keys = {f"{k}.{sub}" for k, v in gateway.items() if isinstance(v, dict) for sub in v}
    set_keys |= {k for k, v in gateway.items() if not isinstance(v, dict)}
    assert set_keys == set(config.file_keys(config.GatewayConfig)), "this test sets every declared key once"
    spath = tmp_path / "settings.json"
    spath.write_text(json.dumps({"gateway": gateway}, indent=2), encoding="utf-8")
    g = config.load_settings(spath).gateway
    assert (g.listen_host, g.listen_port, g.upstream_base_url) == ("0.0.0.0", 9001, "https://api.example.com/v1")
    assert (g.api_key_env, g.upstream_api_key_env, g.request_timeout_s, g.max_retries) == ("MY_KEY", "UP_KEY", 5, 0)
    assert (g.max_body_bytes, g.drain_timeout_s, g.metrics_public, g.fallback) == (2048, 0, True, "decode")
    assert g.workers == 3
    assert (g.max_header_bytes, g.max_headers, g.header_timeout_s, g.body_timeout_s) == (4096, 20, 3, 4)
    assert (g.max_connections, g.keepalive_timeout_s, g.migration_limit, g.stall_timeout_s) == (10, 7.5, 0, 12.5)
    assert g.rate_limit == config.RateLimitConfig(60, 1000, 4)
    # Relative paths are relative to settings.json's folder, wherever pdctl runs from.
    assert (g.keys_file, g.tls_certfile, g.tls_keyfile) == (
        str(tmp_path / "keys.json"),
        str(tmp_path / "certs" / "cert.pem"),
        "/abs/key.pem",
    )
    assert config.load_settings(RECIPE / "settings.json").gateway.rate_limit == config.RateLimitConfig()


def test_toml_syntax_error_has_line_and_column(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(config_edits={"max_num_seqs = 8\n": "max_num_seqs = = 8\n"})
    with pytest.raises(ConfigError) as info:
        load(cpath, spath)
    assert info.value.line == 22 and info.value.column is not None
    assert str(info.value).startswith("config.toml:22:")
    assert "invalid TOML" in str(info.value)


def test_json_syntax_error_has_line_and_column(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(settings_edits={'"max_retries": 2\n': '"max_retries": 2,\n'})
    with pytest.raises(ConfigError) as info:
        load(cpath, spath)
    assert (info.value.line, info.value.column) == (8, 3)
    assert str(info.value) == "settings.json:8:3: invalid JSON: Expecting property name enclosed in double quotes"


def test_missing_file_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path / "config.toml", tmp_path / "settings.json")
    assert "file not found" in str(info.value) and "pdctl init" in (info.value.hint or "")


def test_several_instances_per_role(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(
        config_edits={"[decode]": "[[decode]]"},
        settings_edits={
            '"decode_endpoint": "http://127.0.0.1:8200"': '"decode_endpoint": ["http://127.0.0.1:8200", "http://127.0.0.1:8300"]'
        },
        config_append='\n[[decode]]\nmodel = "Qwen/Qwen3-8B"\ngpu_ids = [2]\n',
    )
    text = cpath.read_text()
    # move [connector] above the second [[decode]] is not needed: TOML arrays of tables may be split.
    dep = load(cpath, spath)
    assert [w.name for w in dep.decode] == ["decode-0", "decode-1"]
    assert [w.port for w in dep.decode] == [8200, 8300]
    assert dep.decode[0].side_channel_port != dep.decode[1].side_channel_port
    assert "[[decode]]" in text
    # settings.json alone (the gateway without config.toml) names the instances as config.toml's loader does.
    alone = from_settings(config.load_settings(spath))
    assert [i.name for i in alone.instances] == [w.name for w in dep.workers] == ["prefill", "decode-0", "decode-1"]
    assert config.load_settings(spath) == dep.settings


def test_endpoint_count_must_match_instances(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(
        settings_edits={
            '"decode_endpoint": "http://127.0.0.1:8200"': '"decode_endpoint": ["http://127.0.0.1:8200", "http://127.0.0.1:8300"]'
        },
    )
    with pytest.raises(ConfigError) as info:
        load(cpath, spath)
    assert str(info.value).startswith("settings.json:11: routing.decode_endpoint: 1 decode instance(s)")


def test_extensions(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(
        config_edits={
            'role = "prefill"\n': 'role = "prefill"\nengine = "sim"\ncpu_ids = [0]\nhost = "0.0.0.0"\n'
            'env = { VLLM_CPU_KVCACHE_SPACE = "1" }\nextra_args = ["--enforce-eager"]\n'
            'side_channel_port = 5650\nmax_model_len = 1024\ndtype = "bfloat16"\n'
            'served_model_name = "qwen"\n'
        },
        config_append='\n[supervisor]\nready_timeout_s = 60\nrestart = "on-failure"\n',
    )
    dep = load(cpath, spath)
    p = dep.prefill[0]
    assert (p.engine, p.cpu_ids, p.host, p.env, p.extra_args) == (
        "sim",
        (0,),
        "0.0.0.0",
        {"VLLM_CPU_KVCACHE_SPACE": "1"},
        ("--enforce-eager",),
    )
    assert (p.side_channel_port, p.max_model_len, p.dtype, p.model_name) == (5650, 1024, "bfloat16", "qwen")
    assert dep.supervisor.ready_timeout_s == 60 and dep.supervisor.restart == "on-failure"


def test_parse_endpoint_and_listen() -> None:
    assert config.parse_endpoint("http://127.0.0.1:8100") == ("127.0.0.1", 8100)
    assert config.parse_listen("[::1]:8000") == ("::1", 8000)
    with pytest.raises(ValueError):
        config.parse_endpoint("127.0.0.1:8100")


def test_settings_json_given_as_config_gets_a_hint(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """The recipe spells it `pdctl gateway --config settings.json`; -c takes config.toml."""
    (tmp_path / "settings.json").write_bytes((RECIPE / "settings.json").read_bytes())
    monkeypatch.chdir(tmp_path)
    res = cli("gateway", "--config", "settings.json", env={"TAOTOKEN_API_KEY": "sk-x"})
    assert res.exit_code == 2
    assert "settings.json:1:0: invalid TOML" in res.output
    assert "pass it with -s/--settings (-c/--config takes config.toml)" in res.output
    assert "Traceback" not in res.output


def test_check_with_relative_paths_names_lines(tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    for name in ("config.toml", "settings.json"):
        (tmp_path / name).write_bytes((RECIPE / name).read_bytes())
    monkeypatch.chdir(tmp_path)
    res = cli("check", "--json", "--no-vllm-parse", env={"TAOTOKEN_API_KEY": "sk-x"})
    pd024 = [f for f in json.loads(res.stdout)["findings"] if f["code"] == "PD024"]
    assert [(f["file"], f["line"]) for f in pd024] == [("config.toml", 21)]


def test_plan_shows_the_cluster_name(recipe_files, cli) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files({'name = "pd-disagg-demo"': 'name = "team-a-pd"'})
    res = cli("plan", "-c", str(cpath), "-s", str(spath), "--json")
    assert json.loads(res.stdout)["cluster"] == "team-a-pd"
    res = cli("plan", "-c", str(cpath), "-s", str(spath))
    assert res.stdout.splitlines()[0] == "deployment team-a-pd"


def test_every_declared_worker_key_reaches_its_flag_or_env(recipe_files) -> None:  # type: ignore[no-untyped-def]
    """Each key declared with a flag or env (config.key) is read by the loader and lands where it says."""
    from pdctl.runtime.plan import VllmInstall, build_plan

    extra = (
        'served_model_name = "q"\nhost = "0.0.0.0"\nkv_connector = "NixlConnector"\ngpu_memory_utilization = 0.5\n'
        'max_model_len = 4096\ndtype = "bfloat16"\nblock_size = 32\nenforce_eager = true\ncpu_ids = [2, 3]\n'
        "side_channel_port = 6100\n"
    )
    cpath, spath = recipe_files({"enable_chunked_prefill = false\n": "enable_chunked_prefill = false\n" + extra,
                                 "tensor_parallel_size = 1\nenable": "tensor_parallel_size = 2\nenable"})  # fmt: skip
    pre = build_plan(load(cpath, spath), VllmInstall("vllm", "0.32.0")).get("prefill")
    for name, spec in config.keys_of(config.WorkerConfig).items():
        if spec.flag and spec.emit:
            assert spec.flag in pre.argv or "--no-" + spec.flag[2:] in pre.argv, name
        if spec.env:
            assert spec.env in pre.env, name
    assert pre.argv[pre.argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-chunked-prefill" in pre.argv and "--enforce-eager" in pre.argv
    assert pre.env["VLLM_CPU_OMP_THREADS_BIND"] == "2,3" and pre.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "6100"
