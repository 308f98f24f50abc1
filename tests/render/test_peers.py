"""`pdctl render vllm-router`: a peer router's command line from the same two files."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from tests.conftest import REPO

P2D2 = REPO / "tests" / "configs" / "k8s-2p2d"


def files(folder: Path) -> list[str]:
    return ["-c", str(folder / "config.toml"), "-s", str(folder / "settings.json")]


def test_vllm_router_gets_every_worker_of_the_settings(cli: Any) -> None:
    result = cli("render", "vllm-router", *files(P2D2))
    assert result.exit_code == 0, result.output
    assert shlex.split(result.output) == [
        "vllm-router", "--vllm-pd-disaggregation", "--kv-connector", "nixl",
        "--prefill", "http://127.0.0.1:8100", "none", "--prefill", "http://127.0.0.1:8101", "none",
        "--decode", "http://127.0.0.1:8200", "--decode", "http://127.0.0.1:8201",
        "--host", "127.0.0.1", "--port", "8000", "--request-timeout-secs", "120",
    ]  # fmt: skip


def test_vllm_router_in_the_cluster_names_the_rendered_services(cli: Any) -> None:
    argv = shlex.split(cli("render", "vllm-router", "--k8s", *files(P2D2)).output)
    assert argv[argv.index("--prefill") + 1] == "http://prefill-0:8100"
    assert argv[argv.index("--decode") + 1] == "http://decode-0:8200"
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


def test_a_connector_vllm_router_cannot_route_is_refused(cli: Any, recipe_files: Any) -> None:
    cpath, spath = recipe_files(
        config_edits={'kv_connector = "NixlConnector"': 'kv_connector = "ExampleConnector"'},
        settings_edits={'"kv_connector": "NixlConnector"': '"kv_connector": "ExampleConnector"'},
    )
    result = cli("render", "vllm-router", "-c", str(cpath), "-s", str(spath))
    assert result.exit_code == 1
    assert "vllm-router has no PD mode for ExampleConnector" in result.output
    assert "hint:" in result.output
