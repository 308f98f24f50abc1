"""Per-user keys, quotas, the upstream key, tokenizer counts and TLS (issue 17, items 1-3 and the key parts of 6).

Two users share one simulator deployment with their own limits; a revoked key gets 401 after the reload; the
fake upstream records every header it receives, so a client key reaching it would show.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.config import RateLimitConfig
from pdctl.errors import ConfigError
from pdctl.gateway.app import Gateway, create_app
from pdctl.gateway.keys import KeyRing, add_key, hash_key, load_keys, revoke_key
from pdctl.gateway.memory import MemoryReply, MemoryWorkers
from pdctl.gateway.server import tls_files
from pdctl.gateway.settings import GatewaySettings, LocalModel
from pdctl.gateway.tokens import TokenCounter, estimate_tokens
from pdctl.runtime.rundir import gateway_counters
from pdctl.testing import SimProcess, free_port
from pdctl.vllm.transport import TransportError
from tests.conftest import REPO
from tests.fakes.gateway_harness import (
    UPSTREAM_KEY,
    FakeProc,
    GatewayThread,
    asgi_request,
    make_settings,
    wait_for,
)
from tests.fakes.helpers import self_signed_cert
from tests.gateway.test_on_sim import _pair

CHAT = "/v1/chat/completions"
NO_LIMITS = RateLimitConfig()


def _with_keys(settings: GatewaySettings, keys_file: Path, **gateway: Any) -> GatewaySettings:
    return replace(settings, gateway=replace(settings.gateway, keys_file=str(keys_file), **gateway))


def _chat(model: str, text: str = "hello", max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": stream}  # fmt: skip


# ------------------------------------------------------------------------------------- the keys file


def test_keys_file_stores_only_digests_and_reports_bad_entries(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    key = add_key(path, "alice", RateLimitConfig(60, 1000, 2), ("sim-model",), upstream=False)
    text = path.read_text()
    assert key.startswith("sk-pdctl-") and len(key) > 40
    assert key not in text and hash_key(key) in text
    assert path.stat().st_mode & 0o777 == 0o600
    (alice,) = load_keys(path)
    assert (alice.name, alice.limits, alice.models, alice.upstream) == ("alice", RateLimitConfig(60, 1000, 2),
                                                                        ("sim-model",), False)  # fmt: skip
    with pytest.raises(Exception, match="exists"):
        add_key(path, "alice", NO_LIMITS, None, True)

    bad = tmp_path / "bad.json"
    bad.write_text('{"keys": [\n  {"name": "ok", "sha256": "' + "a" * 64 + '"},\n  {"name": "bob",\n'
                   '   "sha256": "sk-pasted-the-key-itself"}\n]}\n')  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_keys(bad)
    assert err.value.file == "bad.json" and err.value.key == "keys[1].sha256" and err.value.line == 4
    assert "never the key" in str(err.value) and err.value.hint and "pdctl keys add" in err.value.hint

    bad.write_text('{"keys": [{"name": "ci", "env": "PDCTL_TEST_UNSET_KEY_VAR"}]}')
    with pytest.raises(ConfigError, match="PDCTL_TEST_UNSET_KEY_VAR is not set"):
        load_keys(bad, environ={})
    (ci,) = load_keys(bad, environ={"PDCTL_TEST_UNSET_KEY_VAR": "sk-from-env-0123456789"})
    assert ci.digest.hex() == hash_key("sk-from-env-0123456789")


def test_operator_key_stays_beside_the_file_across_reloads(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    alice = add_key(path, "alice", NO_LIMITS, None, True)
    ring = KeyRing.from_file(path, "sk-operator-key-0123456789")
    assert [ring.identify(f"Bearer {k}".encode()).name for k in (alice, "sk-operator-key-0123456789")] == [  # type: ignore[union-attr]
        "alice", "default"]  # fmt: skip
    revoke_key(path, "alice")
    assert ring.reload() and ring.identify(f"Bearer {alice}".encode()) is None
    assert ring.identify(b"Bearer sk-operator-key-0123456789") is not None
    path.write_text(json.dumps({"keys": [{"name": "default", "sha256": "b" * 64}]}))
    with pytest.raises(ConfigError, match="reserved"):
        load_keys(path)


def test_keys_cli_add_list_revoke(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}

    def pdctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdctl", "keys", *args, "--file", str(path)], env=env,
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip

    added = pdctl("add", "alice", "--rpm", "5", "--model", "sim-model", "--no-upstream")
    assert added.returncode == 0, added.stderr
    (key,) = [w for w in added.stdout.split() if w.startswith("sk-pdctl-")]
    assert KeyRing.from_file(path).identify(f"Bearer {key}".encode()) is not None
    listed = pdctl("list")
    assert "alice" in listed.stdout and "sim-model" in listed.stdout and key not in listed.stdout
    assert hash_key(key) not in listed.stdout
    assert pdctl("revoke", "alice").returncode == 0
    assert KeyRing.from_file(path).identify(f"Bearer {key}".encode()) is None
    missing = pdctl("revoke", "alice")
    assert missing.returncode != 0 and "no key named 'alice'" in missing.stdout + missing.stderr
    assert "Traceback" not in missing.stdout + missing.stderr


# ------------------------------------------------------------------------- two users, one deployment


def test_two_users_with_own_quotas_share_one_deployment(sim_procs: list[SimProcess], tmp_path: Path) -> None:
    p, d = _pair(sim_procs, tmp_path)
    keys = tmp_path / "keys.json"
    alice = add_key(keys, "alice", RateLimitConfig(requests_per_minute=2), None, True)
    bob = add_key(keys, "bob", RateLimitConfig(requests_per_minute=50), None, True)
    settings = _with_keys(make_settings([p.url], [d.url], models=(LocalModel("sim-model", 1024),)), keys)
    gw = GatewayThread(settings, key="")
    try:
        assert wait_for(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, timeout=20)
        with gw.client(alice) as a, gw.client(bob) as b:
            assert [a.post(CHAT, json=_chat("sim-model")).status_code for _ in range(2)] == [200, 200]
            refused = a.post(CHAT, json=_chat("sim-model"))
            assert refused.status_code == 429 and refused.headers["retry-after"]
            err = refused.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
            assert "'alice'" in err["message"] and alice not in refused.text
            assert [b.post(CHAT, json=_chat("sim-model")).status_code for _ in range(4)] == [200] * 4
        text = gw.metrics_text()
        assert 'pdctl_key_requests_total{key="alice",status="200"} 2.0' in text
        assert 'pdctl_key_requests_total{key="alice",status="429"} 1.0' in text
        assert 'pdctl_key_requests_total{key="bob",status="200"} 4.0' in text
        assert alice not in text and bob not in text and hash_key(alice) not in text
    finally:
        gw.stop()


def test_quota_exhausted_mid_stream_keeps_the_stream_and_refuses_the_next(
    sim_procs: list[SimProcess], tmp_path: Path
) -> None:
    """The stream was charged at admission (prompt + max_tokens), so it runs to its end; the next request of
    the same key is refused while the other key goes on."""
    p, d = _pair(sim_procs, tmp_path)
    keys = tmp_path / "keys.json"
    alice = add_key(keys, "alice", RateLimitConfig(tokens_per_minute=300), None, True)
    bob = add_key(keys, "bob", NO_LIMITS, None, True)
    settings = _with_keys(make_settings([p.url], [d.url], models=(LocalModel("sim-model", 1024),)), keys)
    gw = GatewayThread(settings, key="")
    try:
        assert wait_for(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, timeout=20)
        with gw.client(alice) as a, gw.client(bob) as b:
            with a.stream("POST", CHAT, json=_chat("sim-model", "tell me a story", 200, stream=True)) as s:
                assert s.status_code == 200
                lines = s.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert "error" not in json.loads(first.removeprefix("data: "))
                refused = a.post(CHAT, json=_chat("sim-model", "and another", 100, stream=True))
                assert refused.status_code == 429
                assert refused.json()["error"]["code"] == "rate_limit_exceeded"
                assert "300 tokens per minute" in refused.json()["error"]["message"]
                assert b.post(CHAT, json=_chat("sim-model", max_tokens=100)).status_code == 200
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    finally:
        gw.stop()


# ------------------------------------------------------------------------ revocation and reload


def _memory_gateway(settings: GatewaySettings) -> tuple[Gateway, MemoryWorkers]:
    workers = MemoryWorkers()
    kv = {"remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h", "remote_port": 1,
          "do_remote_prefill": True, "do_remote_decode": False, "remote_request_id": "r"}  # fmt: skip
    workers["prefill"].default = MemoryReply.json({"id": "p", "choices": [{"index": 0, "text": "x"}],
                                                   "kv_transfer_params": kv})  # fmt: skip
    workers["decode"].default = MemoryReply.json({"id": "cmpl-d", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "hi"}}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})  # fmt: skip
    return create_app(settings, None, clients=workers), workers


def test_revoked_key_gets_401_after_the_file_reload(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    alice = add_key(keys, "alice", NO_LIMITS, None, True)
    bob = add_key(keys, "bob", NO_LIMITS, None, True)
    app, _ = _memory_gateway(_with_keys(make_settings(["http://prefill.invalid"], ["http://decode.invalid"]), keys))

    async def main() -> None:
        await app.startup()
        try:
            assert (await asgi_request(app, CHAT, _chat("tiny"), key=alice)).status == 200
            revoke_key(keys, "alice")
            deadline = time.monotonic() + 5
            reply = await asgi_request(app, CHAT, _chat("tiny"), key=alice)
            while reply.status == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                reply = await asgi_request(app, CHAT, _chat("tiny"), key=alice)
            assert reply.status == 401
            assert reply.json() == {"error": {
                "message": "invalid or missing API key: send `Authorization: Bearer <key>`",
                "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}  # fmt: skip
            assert (await asgi_request(app, CHAT, _chat("tiny"), key=bob)).status == 200
            keys.write_text("{not json")  # a broken edit keeps the keys in force
            app.reload_keys()
            assert (await asgi_request(app, CHAT, _chat("tiny"), key=bob)).status == 200
        finally:
            await app.shutdown()

    asyncio.run(main())


def test_one_keys_concurrency_cap_leaves_the_other_key_alone(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    alice = add_key(keys, "alice", RateLimitConfig(max_concurrency=1), None, True)
    bob = add_key(keys, "bob", NO_LIMITS, None, True)
    app, workers = _memory_gateway(_with_keys(make_settings(["http://prefill.invalid"], ["http://decode.invalid"]),
                                              keys))  # fmt: skip
    slow = workers["decode"].default
    assert isinstance(slow, MemoryReply)
    workers["decode"].default = replace(slow, delay_s=0.5)

    async def main() -> None:
        await app.startup()
        try:
            first = asyncio.ensure_future(asgi_request(app, CHAT, _chat("tiny"), key=alice))
            await asyncio.sleep(0.1)
            second, other = await asyncio.gather(asgi_request(app, CHAT, _chat("tiny"), key=alice),
                                                 asgi_request(app, CHAT, _chat("tiny"), key=bob))  # fmt: skip
            assert second.status == 429 and "concurrent requests for key 'alice'" in second.json()["error"]["message"]
            assert other.status == 200 and (await first).status == 200
            assert (await asgi_request(app, CHAT, _chat("tiny"), key=alice)).status == 200  # released
        finally:
            await app.shutdown()

    asyncio.run(main())


def test_key_limited_to_models_and_kept_off_the_upstream(tmp_path: Path) -> None:
    up = FakeProc("fake_upstream.py", {"models": ["gpt-x"], "key": UPSTREAM_KEY})
    try:
        keys = tmp_path / "keys.json"
        local_only = add_key(keys, "local", NO_LIMITS, ("tiny",), upstream=False)
        everything = add_key(keys, "all", NO_LIMITS, None, True)
        settings = _with_keys(make_settings(["http://p.invalid"], ["http://d.invalid"], upstream=up.url + "/v1"), keys)
        workers = MemoryWorkers()
        app = create_app(settings, None, UPSTREAM_KEY, clients=workers)

        async def main() -> None:
            await app.startup()
            try:
                denied = await asgi_request(app, CHAT, _chat("gpt-x"), key=local_only)
                assert denied.status == 403
                assert denied.json()["error"]["code"] == "model_not_allowed"
                assert denied.json()["error"]["type"] == "permission_error"
                ok = await asgi_request(app, CHAT, _chat("gpt-x"), key=everything)
                assert ok.status == 200, ok.body
            finally:
                await app.shutdown()

        asyncio.run(main())
        calls = up.completions()
        assert len(calls) == 1
        seen = json.dumps(calls)
        assert calls[0]["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
        assert everything not in seen and local_only not in seen
    finally:
        up.kill()


def test_prefill_fallback_to_the_upstream_respects_the_keys_right(tmp_path: Path) -> None:
    """gateway.fallback = "upstream" sends a request upstream only for a key that may use the upstream."""
    up = FakeProc("fake_upstream.py", {"models": ["tiny"], "key": UPSTREAM_KEY})
    try:
        keys = tmp_path / "keys.json"
        local_only = add_key(keys, "local", NO_LIMITS, None, upstream=False)
        everything = add_key(keys, "all", NO_LIMITS, None, True)
        base = make_settings(["http://p.invalid"], ["http://d.invalid"], upstream=up.url + "/v1", max_retries=0,
                             fallback="upstream")  # fmt: skip
        workers = MemoryWorkers()
        app = create_app(_with_keys(base, keys), None, UPSTREAM_KEY, clients=workers)

        async def main() -> None:
            await app.startup()
            try:
                workers["prefill"].script(TransportError("connect", "refused"))
                denied = await asgi_request(app, CHAT, _chat("tiny"), key=local_only)
                assert denied.status == 502, denied.body  # the prefill's failure, not the upstream's answer
                workers["prefill"].script(TransportError("connect", "refused"))
                ok = await asgi_request(app, CHAT, _chat("tiny"), key=everything)
                assert ok.status == 200 and ok.headers["x-pd-path"] == "upstream", ok.body
            finally:
                await app.shutdown()

        asyncio.run(main())
        assert len(up.completions()) == 1
    finally:
        up.kill()


def test_upstream_never_sees_a_client_key(tmp_path: Path) -> None:
    up = FakeProc("fake_upstream.py", {"models": ["gpt-x"], "key": UPSTREAM_KEY})
    try:
        client_key = "sk-single-client-key-0123456789"
        single = make_settings(["http://p.invalid"], ["http://d.invalid"], upstream=up.url + "/v1")
        gw = GatewayThread(single, key=client_key, upstream_key=UPSTREAM_KEY)
        try:
            with gw.client(client_key) as c:
                assert c.post(CHAT, json=_chat("gpt-x")).status_code == 200
                assert c.post(CHAT, json=_chat("gpt-x", stream=True)).status_code == 200
        finally:
            gw.stop()
        keys = tmp_path / "keys.json"
        user_key = add_key(keys, "user", NO_LIMITS, None, True)
        with pytest.raises(ConfigError) as err:
            create_app(_with_keys(single, keys), None)  # per-user keys need the upstream's own key
        assert err.value.key == "gateway.upstream_api_key_env"
        gw = GatewayThread(_with_keys(single, keys), key="", upstream_key=UPSTREAM_KEY)
        try:
            with gw.client(user_key) as c:
                assert c.post(CHAT, json=_chat("gpt-x")).status_code == 200
        finally:
            gw.stop()
        calls = up.completions()
        assert len(calls) == 3
        seen = json.dumps(up.log())
        assert client_key not in seen and user_key not in seen
        assert {c["headers"]["authorization"] for c in calls} == {f"Bearer {UPSTREAM_KEY}"}
    finally:
        up.kill()


def test_metrics_need_a_key_beyond_loopback(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    alice = add_key(keys, "alice", NO_LIMITS, None, True)
    base = make_settings(["http://p.invalid"], ["http://d.invalid"])
    wide = GatewayThread(_with_keys(base, keys, listen_host="0.0.0.0"), key="")
    local = GatewayThread(_with_keys(base, keys), key="")
    try:
        refused = httpx.get(wide.url + "/metrics", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        allowed = httpx.get(wide.url + "/metrics", headers={"authorization": f"Bearer {alice}"}, timeout=10)
        assert allowed.status_code == 200 and "pdctl_requests" in allowed.text
        assert httpx.get(local.url + "/metrics", timeout=10).status_code == 200
        # `pdctl status` sends $api_key_env's key for the gateway's counters
        assert gateway_counters(wide.url) is None and gateway_counters(wide.url, alice) is not None
    finally:
        wide.stop()
        local.stop()


# ---------------------------------------------------------------------------------------- tokens


def _char_tokenizer(folder: Path) -> Path:
    """A tokenizer.json that makes each non-space character one token."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_token_counts_come_from_the_model_tokenizer(tmp_path: Path) -> None:
    model_dir = _char_tokenizer(tmp_path / "model")
    counter = TokenCounter()
    counter.load({"tiny": str(model_dir), "other": str(tmp_path / "missing")})
    chinese = "请用中文详细解释预填充和解码分离的原理" * 20  # 380 characters
    body = _chat("tiny", chinese)
    assert counter.exact("tiny") and not counter.exact("other")
    assert asyncio.run(counter.count("tiny", body)) == len(chinese)
    long_body = _chat("tiny", "字" * 40_000)  # counted on a thread
    assert asyncio.run(counter.count("tiny", long_body)) == 40_000
    # Without a tokenizer the estimate counts a Chinese character as a token (chars / 6 would say 63).
    assert asyncio.run(counter.count("other", body)) == len(chinese)
    assert estimate_tokens(["hello world, this is english"]) == 7


def test_tpm_limit_counts_chinese_prompts_with_the_tokenizer(tmp_path: Path) -> None:
    model_dir = _char_tokenizer(tmp_path / "model")
    keys = tmp_path / "keys.json"
    alice = add_key(keys, "alice", RateLimitConfig(tokens_per_minute=500), None, True)
    settings = _with_keys(
        make_settings(["http://prefill.invalid"], ["http://decode.invalid"],
                      models=(LocalModel("tiny", 4096, str(model_dir)),)), keys)  # fmt: skip
    app, _ = _memory_gateway(settings)

    async def main() -> None:
        await app.startup()
        try:
            for _ in range(500):  # the tokenizer loads in the background after start-up
                if app.tokens.exact("tiny"):
                    break
                await asyncio.sleep(0.01)
            assert app.tokens.exact("tiny")
            # 600 characters would be ~100 tokens as characters / 6; the tokenizer says 600.
            reply = await asgi_request(app, CHAT, _chat("tiny", "预" * 600, max_tokens=10), key=alice)
            assert reply.status == 429 and "~610 tokens" in reply.json()["error"]["message"]
            assert (await asgi_request(app, CHAT, _chat("tiny", "预" * 300, max_tokens=10), key=alice)).status == 200
        finally:
            await app.shutdown()

    asyncio.run(main())
    assert app.metrics.registry.get_sample_value("pdctl_key_tokens_total", {"key": "alice"}) == 310


# ------------------------------------------------------------------------------------------- TLS


def test_tls_paths_are_checked_with_the_key_named(tmp_path: Path) -> None:
    base = make_settings(["http://p.invalid"], ["http://d.invalid"]).gateway
    good_cert, good_key = self_signed_cert(tmp_path / "good", days=30)
    old_cert, old_key = self_signed_cert(tmp_path / "old", days=-1)
    assert tls_files(base) is None
    assert tls_files(replace(base, tls_certfile=str(good_cert), tls_keyfile=str(good_key))) == (
        str(good_cert),
        str(good_key),
    )
    cases = [
        (str(tmp_path / "nope.pem"), str(good_key), "gateway.tls_certfile", "no such file"),
        (str(old_cert), str(old_key), "gateway.tls_certfile", "expired"),
        (str(good_key), str(good_key), "gateway.tls_certfile", "not a PEM certificate"),
        (str(good_cert), str(old_key), "gateway.tls_keyfile", "cannot use it"),
    ]
    for cert, key, name, words in cases:
        with pytest.raises(ConfigError) as err:
            tls_files(replace(base, tls_certfile=cert, tls_keyfile=key))
        assert err.value.key == name and words in str(err.value), (cert, key)
        assert err.value.hint


def _gateway_proc(tmp_path: Path, settings: dict[str, Any]) -> tuple[subprocess.Popen[str], int]:
    port = free_port()
    settings["gateway"]["listen"] = f"127.0.0.1:{port}"
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "pdctl", "gateway", "-s", "settings.json"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    return proc, port


def test_tls_with_a_self_signed_certificate_and_sighup_reload(tmp_path: Path) -> None:
    cert, _ = self_signed_cert(tmp_path, days=30)
    alice = add_key(tmp_path / "keys.json", "alice", NO_LIMITS, None, True)
    bob = add_key(tmp_path / "keys.json", "bob", NO_LIMITS, None, True)
    settings = {"gateway": {"keys_file": "keys.json", "tls_certfile": "cert.pem", "tls_keyfile": "key.pem"},
                "routing": {"prefill_endpoint": "http://127.0.0.1:9", "decode_endpoint": "http://127.0.0.1:9"},
                "logging": {"level": "info"}}  # fmt: skip
    proc, port = _gateway_proc(tmp_path, settings)
    try:
        url = f"https://127.0.0.1:{port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert)), timeout=5) as c:

            def up() -> bool:
                try:
                    return c.get(url + "/health").status_code == 200
                except httpx.TransportError:
                    return False

            assert wait_for(up, timeout=30), "the gateway did not come up"
            assert c.get(url + "/v1/models", headers={"authorization": f"Bearer {alice}"}).status_code == 200
            with pytest.raises(httpx.TransportError):
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)  # plain HTTP is not served
            revoke_key(tmp_path / "keys.json", "alice")
            os.kill(proc.pid, signal.SIGHUP)
            assert wait_for(lambda: c.get(url + "/v1/models", headers={"authorization": f"Bearer {alice}"})
                            .status_code == 401, timeout=5)  # fmt: skip
            assert proc.poll() is None  # SIGHUP reloads; it does not end the gateway
            assert c.get(url + "/v1/models", headers={"authorization": f"Bearer {bob}"}).status_code == 200
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0
        assert "keys reloaded" in out and alice not in out and bob not in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_gateway_refuses_an_expired_certificate_without_a_traceback(tmp_path: Path) -> None:
    self_signed_cert(tmp_path, days=-1)
    add_key(tmp_path / "keys.json", "alice", NO_LIMITS, None, True)
    settings = {"gateway": {"keys_file": "keys.json", "tls_certfile": "cert.pem", "tls_keyfile": "key.pem"}}
    proc, _ = _gateway_proc(tmp_path, settings)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "gateway.tls_certfile" in out and "expired" in out and "Traceback" not in out
