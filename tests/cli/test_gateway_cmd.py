"""``pdctl gateway`` as a process: key handling (§5.2), secrets (X2, X3), one log line per request, drain (S7)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdctl.testing import stop_group
from tests.fakes.gateway_harness import KEY, FakeProc, free_port, wait_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


def _settings(tmp_path: Path, p: str, d: str, port: int, **gateway: object) -> Path:
    data = {
        "gateway": {
            "listen": f"127.0.0.1:{port}",
            "api_key_env": "PDCTL_TEST_KEY",
            "request_timeout_s": 20,
            "drain_timeout_s": 10,
            **gateway,
        },
        "routing": {
            "prefill_endpoint": p,
            "decode_endpoint": d,
            "strategy": "pd_disagg",
            "kv_connector": "NixlConnector",
        },
        "logging": {"level": "info", "log_kv_transfer": True},
    }
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def _run(args: list[str], env: dict[str, str], cwd: Path, out: Path) -> subprocess.Popen[bytes]:
    with out.open("wb") as log:  # the child holds its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "pdctl", "gateway", *args],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PDCTL_TEST_KEY"}
    env.update(extra)
    return env


@pytest.fixture
def workers() -> Iterator[tuple[FakeProc, FakeProc]]:
    p = FakeProc("fake_pd_worker.py", {})
    d = FakeProc("fake_pd_worker.py", {"chunks": 8, "chunk_delay": 0.25})
    yield p, d
    p.kill()
    d.kill()


def test_missing_key_refuses_to_start(tmp_path: Path) -> None:
    s = _settings(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2", free_port())
    r = subprocess.run(
        [sys.executable, "-m", "pdctl", "gateway", "-s", str(s)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "PDCTL_TEST_KEY is not set" in r.stderr and "Traceback" not in r.stderr


def test_key_in_settings_explains_the_recipe_mistake(tmp_path: Path) -> None:
    leaked = "sk-9f8e7d6c5b4a39281706abcdef"
    s = _settings(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2", free_port(), api_key_env=leaked)
    r = subprocess.run(
        [sys.executable, "-m", "pdctl", "gateway", "-s", str(s)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "looks like an API key" in r.stderr and "§5.2" in r.stderr
    assert leaked not in r.stderr + r.stdout


def test_process_secrets_log_lines_and_drain(tmp_path: Path, workers: tuple[FakeProc, FakeProc]) -> None:
    """X2, X3 (N5), one access line per request on stdout, S7 drain (N1): /ready false, stream finishes, exit 0."""
    p, d = workers
    port = free_port()
    s = _settings(tmp_path, p.url, d.url, port)
    out = tmp_path / "gateway.out"
    proc = _run(["-s", str(s)], _env(PDCTL_TEST_KEY=KEY), tmp_path, out)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _ok(url + "/ready"), timeout=30), out.read_text()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
            assert c.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "clireq1"}).status_code == 200
            assert c.post("/v1/chat/completions", json={**CHAT, "model": "other"}).status_code == 404
            bad = httpx.post(
                url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY}x"}, timeout=10
            )
            assert bad.status_code == 401 and KEY not in bad.text
            assert KEY not in c.get("/metrics").text

        # a stream in flight when SIGTERM arrives
        chunks: list[bytes] = []

        def stream() -> None:
            with (
                httpx.Client(base_url=url, headers=headers, timeout=30) as c,
                c.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 8, "stream": True}) as r,
            ):
                chunks.extend(r.iter_raw())

        t = threading.Thread(target=stream)
        t.start()
        assert wait_for(lambda: len(d.completions()) == 2, timeout=10), (d.completions(), out.read_text())
        os.kill(proc.pid, signal.SIGTERM)
        assert wait_for(lambda: _status(url + "/ready") == 503, timeout=5)
        late = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10)
        assert late.status_code == 503 and late.headers["retry-after"]
        t.join(30)
        assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
        assert proc.wait(30) == 0
    finally:
        stop_group(proc)
    text = out.read_text()
    assert KEY not in text
    lines = [ln for ln in text.splitlines() if "request_id=clireq1" in ln]
    assert len(lines) == 1 and "path=disagg" in lines[0] and "status=200" in lines[0]
    assert "kv_engine=fake-engine" in lines[0]
    assert "draining" in text


def test_config_toml_names_instances(tmp_path: Path, workers: tuple[FakeProc, FakeProc]) -> None:
    p, d = workers
    port = free_port()
    s = _settings(tmp_path, p.url, d.url, port)
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        '[prefill]\nname = "p0"\nmodel = "tiny"\nmax_model_len = 512\n\n'
        '[decode]\nname = "d0"\nmodel = "tiny"\nmax_model_len = 512\n\n'
        "[kv_transfer]\ntimeout_ms = 5000\n"
    )
    out = tmp_path / "gateway.out"
    proc = _run(["-c", str(cfg), "-s", str(s)], _env(PDCTL_TEST_KEY=KEY), tmp_path, out)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_for(lambda: _ok(url + "/ready"), timeout=30), out.read_text()
        headers = {"authorization": f"Bearer {KEY}"}
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2}, headers=headers, timeout=30)
        assert r.headers["x-pd-prefill"] == "p0" and r.headers["x-pd-decode"] == "d0"
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 600}, headers=headers, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        stop_group(proc)


def _ok(url: str) -> bool:
    return _status(url) == 200


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0
