"""The simulator's KV cache events (``--kv-events-config``), read as a gateway reads real vLLM's.

Each test binds a SUB socket on 127.0.0.1 and starts simulators whose PUB sockets connect to it (a
``tcp://127.0.0.1:PORT`` endpoint connects, as in vLLM); every payload must decode with
:func:`pdctl.vllm.kv_events.decode_batch`. Block size 16 throughout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdctl.sim.__main__ import main
from pdctl.testing import SimProcess, free_port, start_sim
from pdctl.vllm.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SeqStatus,
    SequenceTracker,
    decode_batch,
    parse_seq,
    split_message,
)
from pdctl.vllm.protocol import build_decode_body, build_prefill_body

BS = 16
QUIET_S = 0.4  # how long "nothing was published" is waited for


class Subscriber:
    """A SUB socket bound on loopback; the simulators dial it."""

    def __init__(self, topic: str = "") -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.endpoint)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def wait_connected(self, publishers: int = 1, timeout_s: float = 10.0) -> None:
        """Until the next ``publishers`` handshakes are done, then a moment for our subscription to reach them."""
        for _ in range(publishers):
            assert self.monitor.poll(int(timeout_s * 1000)), "no publisher connected"
            recv_monitor_message(self.monitor)
        # libzmq attaches an accepted peer only when the socket's own thread calls into it; only then does the
        # SUB send that peer its subscription, and a PUB drops what no subscription matches.
        self.sock.getsockopt(zmq.EVENTS)
        time.sleep(0.2)

    def recv(self, timeout_s: float = 10.0) -> tuple[str, int, KVEventBatch]:
        assert self.sock.poll(int(timeout_s * 1000)), "no KV event batch arrived"
        topic, seq, payload = split_message(self.sock.recv_multipart())
        return topic, seq, decode_batch(payload)

    def quiet(self, wait_s: float = QUIET_S) -> bool:
        return not self.sock.poll(int(wait_s * 1000))

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()


def _events_config(endpoint: str, topic: str, **extra: Any) -> str:
    import json

    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic,
                       **extra})  # fmt: skip


def _start(sub: Subscriber, log_dir: Path, *args: str, topic: str = "decode", name: str = "sim",
           role: str = "kv_both", **extra: Any) -> SimProcess:  # fmt: skip
    argv = ["--block-size", str(BS), "--kv-events-config", _events_config(sub.endpoint, topic, **extra), *args]
    return start_sim(argv, str(log_dir), name=name, role=role, env={"VLLM_SERVER_DEV_MODE": "1"})


@pytest.fixture
def sub() -> Iterator[Subscriber]:
    s = Subscriber()
    try:
        yield s
    finally:
        s.close()


@pytest.fixture
def sim(sub: Subscriber, tmp_path: Path) -> Iterator[SimProcess]:
    sp = _start(sub, tmp_path)
    try:
        sub.wait_connected()
        yield sp
    finally:
        sp.stop()


def _complete(sp: SimProcess, prompt: str | list[int], max_tokens: int = 1, **kw: Any) -> dict[str, Any]:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **kw}  # fmt: skip
    r = httpx.post(sp.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _ids(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def _stored(batch: KVEventBatch) -> BlockStored:
    assert len(batch.events) == 1 and isinstance(batch.events[0], BlockStored), batch.events
    return batch.events[0]


def _check_shape(ev: BlockStored) -> None:
    n = len(ev.block_hashes)
    assert n > 0 and all(isinstance(h, int) and 0 <= h < 2**64 for h in ev.block_hashes)
    assert len(ev.token_ids) == n * BS and ev.block_size == BS
    assert (ev.lora_id, ev.medium, ev.lora_name, ev.group_idx) == (None, "GPU", None, 0)
    assert ev.extra_keys == [None] * n and ev.kv_cache_spec_kind == "full_attention"


def test_first_prompt_stores_its_full_blocks_and_a_hit_publishes_nothing(sub: Subscriber, sim: SimProcess) -> None:
    text = " ".join(f"alpha{i}" for i in range(90))
    out = _complete(sim, text)
    prompt = out["choices"][0]["prompt_token_ids"]
    assert len(prompt) % BS  # not block-aligned: a repeat then hits every full block (vLLM recomputes the last)
    topic, seq, batch = sub.recv()
    assert (topic, seq, batch.data_parallel_rank) == ("decode", 0, 0)
    assert abs(batch.ts - time.time()) < 60
    ev = _stored(batch)
    _check_shape(ev)
    assert ev.parent_block_hash is None
    assert len(ev.block_hashes) == len(prompt) // BS and ev.token_ids == prompt[: len(ev.token_ids)]

    body = {"model": "sim-model", "prompt": text, "max_tokens": 1, "stream": True}
    assert httpx.post(sim.url + "/v1/completions", json=body, timeout=30).status_code == 200
    assert sub.quiet()
    _complete(sim, _ids(40))
    assert sub.recv()[1] == 1  # nothing was sent for the repeat


def test_extended_prompt_stores_only_new_blocks_with_the_parent(sub: Subscriber, sim: SimProcess) -> None:
    base = _ids(2 * BS + 5)
    _complete(sim, base)
    first = _stored(sub.recv()[2])
    assert len(first.block_hashes) == 2
    longer = base + _ids(3 * BS, start=5000)
    _complete(sim, longer)
    seq, batch = sub.recv()[1:]
    ev = _stored(batch)
    _check_shape(ev)
    assert seq == 1 and ev.parent_block_hash == first.block_hashes[-1]
    assert len(ev.block_hashes) == 3 and ev.token_ids == longer[2 * BS : 5 * BS]


def test_chat_stores_the_templated_prompt(sub: Subscriber, sim: SimProcess) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": " ".join(["chat words"] * 40)}],
            "max_tokens": 1, "temperature": 0, "return_token_ids": True}  # fmt: skip
    out = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30).json()
    prompt = out["prompt_token_ids"]
    ev = _stored(sub.recv()[2])
    _check_shape(ev)
    assert ev.parent_block_hash is None and ev.token_ids == prompt[: len(prompt) // BS * BS]
    if len(prompt) % BS:
        httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=30)
        assert sub.quiet()


def test_generated_blocks_are_stored_as_the_decode_fills_them(sub: Subscriber, sim: SimProcess) -> None:
    # vLLM caches prompt + output blocks too (KVCacheManager.cache_blocks runs at every step): the third block
    # fills at output token 27, whose KV the next step computes; the last token sampled never gets KV.
    prompt = _ids(BS + 4)
    out = _complete(sim, prompt, max_tokens=40)
    tokens = prompt + out["choices"][0]["token_ids"]
    events = [sub.recv() for _ in range(3)]
    assert [seq for _, seq, _ in events] == [0, 1, 2]
    stored = [_stored(batch) for _, _, batch in events]
    assert [len(ev.block_hashes) for ev in stored] == [1, 1, 1]
    assert stored[0].parent_block_hash is None
    assert stored[1].parent_block_hash == stored[0].block_hashes[0]
    assert stored[2].parent_block_hash == stored[1].block_hashes[0]
    for i, ev in enumerate(stored):
        assert ev.token_ids == tokens[i * BS : (i + 1) * BS]
    assert sub.quiet()  # 20 + 39 computed tokens: three full blocks, no fourth

    # The next turn's prompt (prompt + output) hits the generated blocks: only what follows is stored.
    _complete(sim, tokens[: 3 * BS] + _ids(BS, start=7000))
    ev = _stored(sub.recv()[2])
    assert ev.parent_block_hash == stored[2].block_hashes[0] and ev.token_ids == _ids(BS, start=7000)


def test_eviction_publishes_block_removed(sub: Subscriber, tmp_path: Path) -> None:
    sp = _start(sub, tmp_path, "--num-gpu-blocks-override", "4")
    try:
        sub.wait_connected()
        _complete(sp, _ids(3 * BS + 1))
        old = _stored(sub.recv()[2]).block_hashes
        _complete(sp, _ids(3 * BS + 1, start=3000))
        batch = sub.recv()[2]
        removed = [e for e in batch.events if isinstance(e, BlockRemoved)]
        assert [e.block_hashes for e in removed] == [[old[0]], [old[1]]]  # least recently used first
        assert all(e.medium == "GPU" for e in removed)
        assert isinstance(batch.events[-1], BlockStored) and len(batch.events) == 3
    finally:
        sp.stop()


def test_reset_publishes_all_blocks_cleared_with_the_next_step(sub: Subscriber, sim: SimProcess) -> None:
    prompt = _ids(2 * BS + 3)
    _complete(sim, prompt)
    before = _stored(sub.recv()[2])
    r = httpx.post(sim.url + "/reset_prefix_cache", timeout=10)
    assert r.status_code == 200 and r.json() == {"success": True}
    assert sub.quiet()  # an idle engine holds the event back
    _complete(sim, prompt)
    seq, batch = sub.recv()[1:]
    assert seq == 1 and isinstance(batch.events[0], AllBlocksCleared) and len(batch.events) == 2
    again = batch.events[1]
    assert isinstance(again, BlockStored) and again.parent_block_hash is None
    assert again.block_hashes == before.block_hashes  # the same hash function before and after


def test_reset_is_a_dev_mode_route(tmp_path: Path) -> None:
    sp = start_sim(["--block-size", str(BS)], str(tmp_path))
    try:
        assert httpx.post(sp.url + "/reset_prefix_cache", timeout=10).status_code == 404
    finally:
        sp.stop()


def test_a_restarted_sim_starts_at_seq_0(sub: Subscriber, tmp_path: Path) -> None:
    tracker = SequenceTracker()
    seen: list[tuple[int, SeqStatus]] = []
    for run in range(2):
        sp = _start(sub, tmp_path, name=f"run{run}")
        try:
            sub.wait_connected()
            for i in range(2):
                _complete(sp, _ids(BS + 1, start=100 * i))
                check = tracker.observe(sub.recv()[1])
                seen.append((check.seq, check.status))
        finally:
            sp.stop()
    assert seen == [(0, SeqStatus.FIRST), (1, SeqStatus.NEXT), (0, SeqStatus.RESTART), (1, SeqStatus.NEXT)]


def test_replay_returns_buffered_batches_then_the_end_marker(sub: Subscriber, tmp_path: Path) -> None:
    replay = f"tcp://127.0.0.1:{free_port()}"
    sp = _start(sub, tmp_path, replay_endpoint=replay)
    try:
        sub.wait_connected()
        for i in range(3):
            _complete(sp, _ids(BS + 1, start=100 * i))
            sub.recv()
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(replay)
            dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            got = []
            while True:
                assert dealer.poll(10_000)
                frames = dealer.recv_multipart()
                assert frames[0] == b""
                if parse_seq(frames[2]) == END_SEQ:
                    break
                topic, seq, payload = split_message(frames[1:])
                got.append(seq)
                assert topic == "decode" and isinstance(decode_batch(payload).events[0], BlockStored)
            assert got == [1, 2]
        finally:
            dealer.close(linger=0)
            ctx.term()
    finally:
        sp.stop()


def test_pd_decode_caches_the_pulled_prompt(tmp_path: Path) -> None:
    # vLLM's decode caches the blocks it pulled (Scheduler._update_waiting_for_remote_kv calls cache_blocks).
    sub = Subscriber()
    try:
        prefill = _start(sub, tmp_path, topic="prefill", name="prefill")
        try:
            decode = _start(sub, tmp_path, topic="decode", name="decode")
            try:
                sub.wait_connected(publishers=2)
                body = {"model": "sim-model", "prompt": _ids(3 * BS + 7), "max_tokens": 4, "temperature": 0}
                leg1 = build_prefill_body(body, "params", "/v1/completions")
                p = httpx.post(prefill.url + "/v1/completions", json=leg1, timeout=30)
                params = p.json()["kv_transfer_params"]
                d = httpx.post(decode.url + "/v1/completions", json=build_decode_body(body, params), timeout=30)
                assert d.status_code == 200, d.text
                got = {topic: _stored(batch) for topic, _, batch in (sub.recv(), sub.recv())}
                assert set(got) == {"prefill", "decode"}
                assert got["decode"].token_ids == body["prompt"][: 3 * BS]
                assert got["decode"].block_hashes == got["prefill"].block_hashes
                assert got["decode"].parent_block_hash is None
            finally:
                decode.stop()
        finally:
            prefill.stop()
    finally:
        sub.close()


def test_an_ipc_endpoint_binds(tmp_path: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt_string(zmq.SUBSCRIBE, "")
    endpoint = f"ipc://{tmp_path}/kv-events.sock"
    sp = start_sim(["--block-size", str(BS), "--kv-events-config", _events_config(endpoint, "")], str(tmp_path))
    try:
        sock.connect(endpoint)
        time.sleep(0.3)
        _complete(sp, _ids(BS + 1))
        assert sock.poll(10_000)
        topic, seq, payload = split_message(sock.recv_multipart())
        assert (topic, seq) == ("", 0) and isinstance(decode_batch(payload).events[0], BlockStored)
    finally:
        sp.stop()
        sock.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    ("config", "key", "message"),
    [
        ('{"enable_kv_cache_events": true, "bogus_key": 1}', "bogus_key", "Extra inputs are not permitted"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher", "Input should be 'null' or 'zmq'"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events", "Input should be a valid boolean"),
    ],
)
def test_a_bad_config_is_a_usage_error(config: str, key: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "sim-model", "--kv-events-config", config]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.endswith("argument --kv-events-config: 1 validation error for KVEventsConfig") for ln in lines)
    assert any(ln.endswith(f"] {key}") for ln in lines) and any(message in ln for ln in lines)
    assert not any("Traceback" in ln for ln in lines)
