"""CURVE on the KV events port (routing.kv_events_curve), over real ZMQ sockets on 127.0.0.1: the gateway's
subscriber admits what a worker publishes through its relay, and refuses a plain publisher and a wrong key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from pdctl.errors import ConfigError
from pdctl.gateway.routing.kv_events import EventsRelay, KvEventSubscriber
from pdctl.testing.ports import free_port
from pdctl.vllm import kv_curve
from pdctl.vllm.kv_events import BlockStored, KVEventBatch
from pdctl.vllm.kv_relay import WorkerRelay

WORKERS = ("prefill", "decode", "intruder")
_ENC = msgspec.msgpack.Encoder()


def _frames(topic: str, seq: int) -> list[bytes]:
    ev = BlockStored(block_hashes=[seq + 1], parent_block_hash=None, token_ids=list(range(16)), block_size=16,
                     lora_id=None, medium="GPU", lora_name=None, extra_keys=[None], group_idx=0)  # fmt: skip
    return [topic.encode(), seq.to_bytes(8, "big"), _ENC.encode(KVEventBatch(1.0, [ev], 0))]


def _publisher(ctx: zmq.asyncio.Context, endpoint: str, keys: kv_curve.ClientKeys | None = None) -> Any:
    """A PUB socket that dials ``endpoint`` as vLLM's publisher does (with CURVE keys when given)."""
    pub = ctx.socket(zmq.PUB)
    if keys is not None:
        kv_curve.secure_client(pub, keys)
    pub.connect(endpoint)
    return pub


async def _until(cond: Callable[[], bool], pubs: Sequence[tuple[Any, str]], timeout_s: float = 10) -> bool:
    """Publish one message on each of ``pubs`` (socket, topic) every 20 ms until ``cond()``; whether it held."""
    seq = 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        for pub, topic in pubs:
            await pub.send_multipart(_frames(topic, seq))
        seq += 1
        await asyncio.sleep(0.02)
    return cond()


@contextlib.asynccontextmanager
async def _running(sub: KvEventSubscriber) -> AsyncIterator[zmq.asyncio.Context]:
    """``sub`` listening, and a context for the publishers (their sockets closed on the way out)."""
    task = asyncio.create_task(sub.run())
    ctx = zmq.asyncio.Context()
    try:
        yield ctx
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)


@pytest.fixture
def keys() -> dict[str, str]:
    return kv_curve.new_keys()


def _relay(listen: str, to: str, keys: kv_curve.ClientKeys) -> tuple[WorkerRelay, threading.Event, threading.Thread]:
    relay, stop = WorkerRelay(listen, to, keys), threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    assert relay.bound.wait(5)
    return relay, stop, thread


def test_the_gateway_admits_its_relays_and_refuses_plain_and_foreign_publishers(keys: dict[str, str]) -> None:
    """A worker publishing through its relay reaches its view; a plain publisher and one with a key of another
    set, dialling the gateway's port directly at the same time, never do (their topics are allowed ones)."""
    gateway = f"tcp://127.0.0.1:{free_port()}"
    listen = f"tcp://127.0.0.1:{free_port()}"
    counted: list[tuple[str, str]] = []
    sub = KvEventSubscriber(gateway, lambda t, w: counted.append((t, w)), allowed=WORKERS.__contains__,
                            curve=kv_curve.server_keys(keys))  # fmt: skip
    relay, stop, thread = _relay(listen, gateway, kv_curve.client_keys(keys))
    foreign = kv_curve.client_keys(
        {**kv_curve.new_keys(), kv_curve.SERVER_PUBLIC_ENV: keys[kv_curve.SERVER_PUBLIC_ENV]}
    )

    async def main() -> None:
        async with _running(sub) as ctx:
            worker, plain = _publisher(ctx, listen), _publisher(ctx, gateway)
            pubs = [(worker, "prefill"), (plain, "decode"), (_publisher(ctx, gateway, foreign), "intruder")]
            assert await _until(lambda: sub.view("prefill") is not None and relay.forwarded >= 50, pubs)
            assert sub.view("decode") is None and sub.view("intruder") is None
            assert {t for t, _ in counted} == {"prefill"}

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_the_multi_process_parent_is_the_curve_server(keys: dict[str, str], tmp_path: Path) -> None:
    """With gateway.workers > 1 the parent's relay binds the port: CURVE there, plain ipc to its children."""
    gateway = f"tcp://127.0.0.1:{free_port()}"
    listen = f"tcp://127.0.0.1:{free_port()}"
    parent = EventsRelay(gateway, tmp_path / "relay.ipc", kv_curve.server_keys(keys))
    parent.start()
    child = KvEventSubscriber(parent.endpoint, connect=True, allowed=WORKERS.__contains__)
    _, stop, thread = _relay(listen, gateway, kv_curve.client_keys(keys))

    async def main() -> None:
        async with _running(child) as ctx:
            worker, plain = _publisher(ctx, listen), _publisher(ctx, gateway)
            assert await _until(lambda: child.view("prefill") is not None, [(worker, "prefill"), (plain, "decode")])
            assert child.view("decode") is None

    try:
        asyncio.run(main())
    finally:
        stop.set()
        thread.join(5)
        parent.close()


def test_missing_or_malformed_keys_name_the_variable(keys: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as err:
        kv_curve.server_keys({})
    assert err.value.key == kv_curve.SERVER_SECRET_ENV and "pdctl keys kv-events" in str(err.value.hint)
    only_secret = {kv_curve.SERVER_SECRET_ENV: keys[kv_curve.SERVER_SECRET_ENV]}
    with pytest.raises(ConfigError) as err:
        kv_curve.server_keys(only_secret)
    assert err.value.key == kv_curve.CLIENT_PUBLIC_ENV
    with pytest.raises(ConfigError) as err:
        kv_curve.client_keys({kv_curve.CLIENT_SECRET_ENV: keys[kv_curve.CLIENT_SECRET_ENV]})
    assert err.value.key == kv_curve.SERVER_PUBLIC_ENV
    bad = "x" * 39 + "~"
    with pytest.raises(ConfigError) as err:
        kv_curve.client_keys({**keys, kv_curve.CLIENT_SECRET_ENV: bad})
    assert err.value.key == kv_curve.CLIENT_SECRET_ENV and bad not in str(err.value)
    with pytest.raises(ConfigError, match="40 characters"):
        kv_curve.server_keys({**keys, kv_curve.SERVER_SECRET_ENV: "short"})
    # The public keys follow from the secret ones when they are not given.
    derived = kv_curve.server_keys({k: v for k, v in keys.items() if k != kv_curve.CLIENT_PUBLIC_ENV})
    assert derived.clients == {keys[kv_curve.CLIENT_PUBLIC_ENV].encode()}
    client = kv_curve.client_keys({k: v for k, v in keys.items() if k != kv_curve.SERVER_PUBLIC_ENV})
    assert client.server == keys[kv_curve.SERVER_PUBLIC_ENV].encode()


def test_the_relay_command_forwards_and_stops_on_sigterm_and_logs_no_key(keys: dict[str, str]) -> None:
    """``pdctl kv-relay`` as ``up`` starts it: keys in its environment only, none in its argv or output."""
    gateway = f"tcp://127.0.0.1:{free_port()}"
    listen = f"127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "pdctl", "kv-relay", "--listen", listen, "--to", gateway]
    env = {**os.environ, **keys, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    sub = KvEventSubscriber(gateway, allowed=WORKERS.__contains__, curve=kv_curve.server_keys(keys))

    async def main() -> None:
        async with _running(sub) as ctx:
            worker = _publisher(ctx, f"tcp://{listen}")
            assert await _until(lambda: sub.view("decode") is not None, [(worker, "decode")], timeout_s=30)

    try:
        asyncio.run(main())
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.decode()
    assert proc.returncode == 0, text
    assert "stopped after forwarding" in text and f"tcp://{listen}" in text
    for value in keys.values():
        assert value not in text and value not in " ".join(argv)


def test_the_relay_command_without_keys_is_one_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in kv_curve.ENV_NAMES} | {"PYTHONPATH": os.getcwd()}
    argv = [sys.executable, "-m", "pdctl", "kv-relay", "--listen", "127.0.0.1:1", "--to", "tcp://127.0.0.1:2"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert kv_curve.CLIENT_SECRET_ENV in done.stderr and "pdctl keys kv-events" in done.stderr
    assert "Traceback" not in done.stderr


def test_keys_command_writes_a_private_env_file_and_a_secret(cli: Any, tmp_path: Path) -> None:
    out = tmp_path / "kv.env"
    result: Any = cli("keys", "kv-events", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert out.stat().st_mode & 0o777 == 0o600
    text = out.read_text()
    # What a shell reads from it (Z85 has characters a shell would otherwise expand).
    shown = subprocess.run(["sh", "-c", f"set -a; . {out}; env"], capture_output=True, text=True, check=True).stdout
    values = {k: v for k, _, v in (line.partition("=") for line in shown.splitlines()) if k in kv_curve.ENV_NAMES}
    assert sorted(values) == sorted(kv_curve.ENV_NAMES) and all(len(v) == 40 for v in values.values())
    assert kv_curve.server_keys(values).clients == {values[kv_curve.CLIENT_PUBLIC_ENV].encode()}
    assert not any(v in result.output for v in values.values())
    again: Any = cli("keys", "kv-events", "-o", str(out))
    assert again.exit_code == 1 and out.read_text() == text
    secret: Any = cli("keys", "kv-events", "--format", "k8s", "--namespace", "llm")
    assert secret.exit_code == 0
    assert f"name: {kv_curve.SECRET_NAME}" in secret.output and "namespace: llm" in secret.output
    assert all(f"  {name}: " in secret.output for name in kv_curve.ENV_NAMES)
