"""Every fix `pdctl check` proposes leads to a deployment that starts (issue 14, item 1).

Each case is the recipe's files (or `pdctl init`'s) switched to the simulator, which copies vLLM's start-up
checks (``max_num_batched_tokens`` vs ``max_model_len``, the model's context length) and the warm-up's
identity rule. For every error finding, each alternative in ``Finding.fixes`` is applied to a fresh copy;
the copy must then check clean (with ``for_up``) and come up with the real ``pdctl up -d``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import tomlkit

from pdctl.check import SETTINGS, Finding, run_checks
from pdctl.config import load
from pdctl.init import write_templates
from pdctl.plan import build_plan
from pdctl.testing import free_port
from tests.conftest import RECIPE

KEY_VAR = "TAOTOKEN_API_KEY"
ENV = {KEY_VAR: "sk-fixes-test-0123456789"}


def _set(doc: tomlkit.TOMLDocument, dotted: str, value: object) -> None:
    """Set (``None``: remove) a dotted key such as ``prefill.max_model_len``, ``prefill[1].engine`` or ``sim``."""
    head, _, leaf = dotted.partition(".")
    if not leaf:
        doc[head] = value
        return
    table = doc.setdefault(head.split("[")[0], tomlkit.table())
    if "[" in head:
        table = table[int(head.split("[")[1].rstrip("]"))]  # type: ignore[index]
    if value is None:
        table.pop(leaf, None)  # type: ignore[union-attr]
    else:
        table[leaf] = value  # type: ignore[index]


def _set_json(settings: dict[str, Any], key: str, value: object) -> None:
    section, _, leaf = key.removeprefix(SETTINGS).partition(".")
    settings[section][leaf] = value


def make_case(d: Path, edits: Mapping[str, object] | None = None, source: Path = RECIPE) -> Path:
    """The files of ``source`` in ``d``, on the simulator with free ports, plus ``edits`` (dotted keys)."""
    d.mkdir(parents=True, exist_ok=True)
    doc = tomlkit.parse((source / "config.toml").read_text(encoding="utf-8"))
    for table in ("prefill", "decode"):
        _set(doc, f"{table}.engine", "sim")
        _set(doc, f"{table}.side_channel_port", free_port())
    doc["supervisor"] = {"ready_timeout_s": 120, "stop_timeout_s": 5, "warmup_timeout_s": 60}
    gateway_port = free_port()
    doc["cluster"]["gateway_host"] = "127.0.0.1"  # type: ignore[index]
    doc["cluster"]["gateway_port"] = gateway_port  # type: ignore[index]
    for key, value in (edits or {}).items():
        if not key.startswith(SETTINGS):
            _set(doc, key, doc["prefill"]["side_channel_port"] if value == "<prefill>" else value)  # type: ignore[index]
    (d / "config.toml").write_text(tomlkit.dumps(doc), encoding="utf-8")
    settings = json.loads((source / "settings.json").read_text(encoding="utf-8"))
    for key, value in (edits or {}).items():
        if key.startswith(SETTINGS):
            _set_json(settings, key, value)
    settings["gateway"]["listen"] = f"127.0.0.1:{gateway_port}"
    settings["gateway"]["drain_timeout_s"] = 2
    settings["routing"]["prefill_endpoint"] = f"http://127.0.0.1:{free_port()}"
    settings["routing"]["decode_endpoint"] = f"http://127.0.0.1:{free_port()}"
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


def errors(d: Path) -> list[Finding]:
    dep = load(d / "config.toml", d / "settings.json")
    return [f for f in run_checks(dep, for_up=True, env=dict(os.environ) | ENV) if f.severity == "error"]


def pdctl(d: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ) | ENV | {"NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "pdctl", *args], cwd=d, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Path]]:
    """Folders whose deployments a test started; each is brought down, and anything left killed."""
    dirs: list[Path] = []
    yield dirs
    for d in dirs:
        pdctl(d, "down")
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
    "sim-kv-scale": (INIT, {"sim": {"profile": "h100", "kv_scale": 0.5}}, {"PD025"}),
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
    d = make_case(tmp_path / "case", edits, src)
    dep = load(d / "config.toml", d / "settings.json")
    found = [
        f for f in run_checks(dep, for_up=True, env=dict(os.environ) | ENV) if f.code in codes or f.severity == "error"
    ]
    assert codes <= {f.code for f in found}
    assert all(f.fixes for f in found), [f for f in found if not f.fixes]
    alternatives = {json.dumps(dict(fix), sort_keys=True): fix for f in found for fix in f.fixes}
    for i, fix in enumerate(alternatives.values()):
        fixed = make_case(tmp_path / f"fix{i}", edits, src)
        apply_fix(fixed, fix)
        after = load(fixed / "config.toml", fixed / "settings.json")
        left = {(f.code, f.key) for f in run_checks(after, for_up=True, env=dict(os.environ) | ENV)}
        assert not left & {(f.code, f.key) for f in found if fix in f.fixes}, (fix, left)
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
