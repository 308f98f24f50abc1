"""The gateway under a hostile client and a hostile network (docs/performance.md, "Hostile clients and hostile
networks"; docs/reliability.md lists each input and what it gets).

Well-behaved streams go through one gateway (``prefix_view = "exact"``, so its KV events port is open) to
simulator workers (one prefill, one decode, each publishing its KV events), measured twice in one run: quiet, then
while an attacker on the same machine

- posts bodies declaring 64 MiB (refused from ``Content-Length``), token-id prompts just under the byte limit sized
  from the model (refused from their commas while they arrive) and just under the value limit (parsed on a thread,
  then refused as longer than ``max_model_len``);
- publishes to the KV events port forged ``BlockStored`` events on the workers' own topics, malformed messages
  (random bytes, unhashable ``extra_keys``) and messages on 20,000 junk topics.

Per phase: the inter-token gap (the time between a stream's consecutive SSE events) p50 / p99, the requests
completed and failed, and the gateway's peak RSS; then p99 under attack / quiet. Every well-behaved request must
end with ``[DONE]``.

    .venv/bin/python -m benchmarks.hostile [--streams 32] [--seconds 20] [--rounds 2] [--inputs ids,events]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil
import zmq
import zmq.asyncio

from benchmarks import _harness as H
from pdctl.gateway.request import body_limit, value_limit
from pdctl.testing import free_port
from pdctl.vllm.kv_events import BlockStored, KVEventBatch

MAX_MODEL_LEN = 4096  # the harness's simulator workers


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    gaps_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    """Per request: (last event - first event) / (events - 1), which a stall raises however the events coalesce."""
    stall_ms: list[float] = field(default_factory=list)
    """Per request: its longest gap."""
    ok: int = 0
    failed: int = 0
    rss_peak: int = 0
    attacks: dict[str, int] = field(default_factory=dict)

    def add(self, other: Phase) -> None:
        """Pool ``other``'s samples into this phase (one of several interleaved rounds)."""
        self.gaps_ms += other.gaps_ms
        self.tpot_ms += other.tpot_ms
        self.stall_ms += other.stall_ms
        self.ok += other.ok
        self.failed += other.failed
        self.rss_peak = max(self.rss_peak, other.rss_peak)
        for k, v in other.attacks.items():
            self.attacks[k] = self.attacks.get(k, 0) + v

    def row(self) -> str:
        return (f"| {self.name} | {H.pct(self.gaps_ms, 50):.1f} | {H.pct(self.gaps_ms, 99):.1f} | "
                f"{H.pct(self.tpot_ms, 99):.1f} | {H.pct(self.stall_ms, 99):.0f} | {self.ok} | {self.failed} | "
                f"{self.rss_peak / 2**20:.0f} |")  # fmt: skip


def _sim(name: str, role: str, logs: str, events_port: int) -> H.Proc:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
              "topic": name}  # fmt: skip
    return H.start_sim(name, role, logs, 1.0, ["--sim-profile", "h100", "--kv-events-config", json.dumps(config)])


def _gateway(logs: str, prefill: str, decode: str, events_port: int) -> H.Proc:
    port = free_port()
    settings = {
        "gateway": {"listen": f"127.0.0.1:{port}", "api_key_env": "PDBENCH_API_KEY", "request_timeout_s": 300},
        "routing": {"prefill_endpoint": prefill, "decode_endpoint": decode, "kv_connector": "NixlConnector",
                    "pd_mode": "adaptive", "prefix_view": "exact", "kv_events_port": events_port},
        "slo": {"ttft_ms": 60000, "tpot_ms": 10000, "p90": True, "admission": False},
        "logging": {"level": "warning"},
    }  # fmt: skip
    path = Path(logs) / "gateway.settings.json"
    path.write_text(json.dumps(settings))
    argv = [H.PY, "-m", "pdctl", "gateway", "-s", str(path)]
    return H.start("gateway", argv, port, logs, env={"PDBENCH_API_KEY": H.KEY}, ready_path="/ready")


async def _stream(client: httpx.AsyncClient, url: str, seed: int, until: float, phase: Phase) -> None:
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    headers = {"authorization": f"Bearer {H.KEY}"}
    while time.perf_counter() < until:
        body = H.completion_body(" ".join(rng.choice(words) for _ in range(40)), 64)
        last: float | None = None
        gaps: list[float] = []
        done = False
        try:
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now - last) * 1000)
                    last = now
                    done = done or line.strip() == "data: [DONE]"
        except httpx.HTTPError:
            done = False
        if done:
            phase.ok += 1
            phase.gaps_ms.extend(gaps)
            if gaps:
                phase.tpot_ms.append(sum(gaps) / len(gaps))
                phase.stall_ms.append(max(gaps))
        else:
            phase.failed += 1


def _ids_body(values: int) -> bytes:
    return b'{"model":"sim-model","max_tokens":1,"prompt":[' + b",".join([b"7"] * values) + b"]}"


INPUTS = ("64MiB", "ids", "ids-at-value-limit", "events")
"""What the attacker can send (``--inputs``): the three bodies and the KV events."""


async def _big_bodies(url: str, until: float, phase: Phase, inputs: tuple[str, ...] = INPUTS) -> None:
    """64 MiB declared (413 from the header), a token-id prompt just under the byte limit (413 from its commas) and
    one just under the value limit (parsed, then a 400)."""
    limit = body_limit(None, [MAX_MODEL_LEN], False)
    values = value_limit(None, [MAX_MODEL_LEN], False)
    assert values is not None
    ids = _ids_body((limit - 100) // 2)
    at_values = _ids_body(values - 8)
    assert len(ids) < limit
    head = {"authorization": f"Bearer {H.KEY}", "content-type": "application/json"}
    bodies = [(w, c) for w, c in (("64MiB", b"x" * (64 << 20)), ("ids", ids), ("ids-at-value-limit", at_values))
              if w in inputs]  # fmt: skip
    if not bodies:
        return
    async with httpx.AsyncClient(timeout=60.0) as client:
        while time.perf_counter() < until:
            for what, content in bodies:
                try:
                    r = await client.post(f"{url}/v1/completions", content=content, headers=head)
                    key = f"{what} -> {r.status_code}"
                except httpx.HTTPError as exc:
                    key = f"{what} -> {type(exc).__name__}"
                phase.attacks[key] = phase.attacks.get(key, 0) + 1


async def _events(port: int, until: float, phase: Phase) -> None:
    """Forged, malformed and junk-topic KV events on the gateway's events port."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(7)
    seq = 1 << 40
    junk = 0
    try:
        await asyncio.sleep(0.5)
        while time.perf_counter() < until:
            seq += 1
            ids = [rng.randrange(50_000) for _ in range(128)]
            forged = BlockStored([rng.randrange(2**63)], None, ids, 128, None, "GPU", None, [None], 0)
            msgs = [
                [b"decode", seq.to_bytes(8, "big"), enc.encode(KVEventBatch(time.time(), [forged], 0))],
                [b"prefill", seq.to_bytes(8, "big"), os.urandom(64)],
                [
                    b"decode",
                    seq.to_bytes(8, "big"),
                    msgspec.msgpack.encode(
                        [
                            1.0,
                            [
                                {
                                    "type": "BlockStored",
                                    "block_hashes": [1],
                                    "parent_block_hash": None,
                                    "token_ids": ids,
                                    "block_size": 128,
                                    "lora_id": None,
                                    "medium": "GPU",
                                    "lora_name": None,
                                    "extra_keys": [[["x", [1]]]],
                                }
                            ],
                            0,
                        ]
                    ),
                ],
            ]
            for _ in range(20):
                if junk < 20_000:
                    msgs.append([f"junk-{junk}".encode(), (0).to_bytes(8, "big"), enc.encode(KVEventBatch(0.0, [], 0))])
                    junk += 1
            for m in msgs:
                await pub.send_multipart(m)
            phase.attacks["kv events sent"] = phase.attacks.get("kv events sent", 0) + len(msgs)
            await asyncio.sleep(0.001)
        phase.attacks["junk topics"] = junk
    finally:
        pub.close(linger=0)
        ctx.term()


async def _rss(pid: int, until: float, phase: Phase) -> None:
    proc = psutil.Process(pid)
    while time.perf_counter() < until:
        phase.rss_peak = max(phase.rss_peak, proc.memory_info().rss)
        await asyncio.sleep(0.2)


async def _phase(name: str, url: str, pid: int, events_port: int, streams: int, seconds: float,
                 attack: bool, inputs: tuple[str, ...] = INPUTS) -> Phase:  # fmt: skip
    phase = Phase(name)
    until = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    attacker = None
    if attack:  # a process of its own: its work must not stall this client's loop, only (if at all) the gateway's
        argv = [H.PY, "-m", "benchmarks.hostile", "--attack", url, str(events_port), str(seconds),
                "--inputs", ",".join(inputs)]  # fmt: skip
        attacker = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        tasks = [_stream(client, url, i, until, phase) for i in range(streams)] + [_rss(pid, until, phase)]
        await asyncio.gather(*tasks)
    if attacker is not None:
        out, _ = await attacker.communicate()
        phase.attacks = json.loads(out.decode().strip().splitlines()[-1])
    return phase


async def _attack(url: str, events_port: int, seconds: float, inputs: tuple[str, ...]) -> dict[str, int]:
    phase = Phase("attacker")
    until = time.perf_counter() + seconds
    tasks = [_big_bodies(url, until, phase, inputs), _big_bodies(url, until, phase, inputs)]
    if "events" in inputs:
        tasks.append(_events(events_port, until, phase))
    await asyncio.gather(*tasks)
    return phase.attacks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0, help="per phase, split over the rounds")
    parser.add_argument("--rounds", type=int, default=2, help="quiet and attack phases, interleaved")
    parser.add_argument("--inputs", default=",".join(INPUTS), help="what the attacker sends, comma-separated: "
                        + ", ".join(INPUTS))  # fmt: skip
    parser.add_argument("--attack", nargs=3, metavar=("URL", "EVENTS_PORT", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    inputs = tuple(x for x in args.inputs.split(",") if x)
    unknown = sorted(set(inputs) - set(INPUTS))
    if unknown:
        parser.error(f"--inputs: unknown {', '.join(unknown)} (choose from {', '.join(INPUTS)})")
    if args.attack:
        url, port, seconds = args.attack
        print(json.dumps(asyncio.run(_attack(url, int(port), float(seconds), inputs))))
        return 0
    events_port = free_port()
    with tempfile.TemporaryDirectory(prefix="pdctl-hostile-") as logs:
        procs: list[H.Proc] = []
        try:
            procs.append(_sim("prefill", "kv_producer", logs, events_port))
            procs.append(_sim("decode", "kv_consumer", logs, events_port))
            gw = _gateway(logs, procs[0].url, procs[1].url, events_port)
            procs.append(gw)
            asyncio.run(_phase("warm-up", gw.url, gw.popen.pid, events_port, args.streams, 3.0, False))
            quiet, hostile = Phase("quiet"), Phase("under attack")
            for _ in range(args.rounds):  # interleaved, so drift and warm-up weigh on both alike
                for into, attack in ((quiet, False), (hostile, True)):
                    into.add(asyncio.run(_phase(into.name, gw.url, gw.popen.pid, events_port, args.streams,
                                                args.seconds / args.rounds, attack, inputs)))  # fmt: skip
            after = asyncio.run(_phase("after", gw.url, gw.popen.pid, events_port, args.streams, 5.0, False))
            metrics = httpx.get(f"{gw.url}/metrics", timeout=10.0).text
        finally:
            for p in reversed(procs):
                with contextlib.suppress(Exception):
                    p.stop()
    print(f"{args.streams} streams of 64 tokens (simulator, h100 profile), {args.seconds:g} s a phase in "
          f"{args.rounds} interleaved rounds, {H.machine()}")  # fmt: skip
    print("| phase | gap p50 ms | gap p99 ms | TPOT p99 ms | longest gap p99 ms | requests ok | failed | "
          "gateway RSS peak MiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for ph in (quiet, hostile, after):
        print(ph.row())
    ratio = H.pct(hostile.gaps_ms, 99) / max(1e-9, H.pct(quiet.gaps_ms, 99))
    tpot = H.pct(hostile.tpot_ms, 99) / max(1e-9, H.pct(quiet.tpot_ms, 99))
    print(f"\ngap p99 under attack / quiet: {ratio:.2f}x; TPOT p99: {tpot:.2f}x")
    print("attacks: " + ", ".join(f"{k}: {v}" for k, v in sorted(hostile.attacks.items())))
    kv = [line for line in metrics.splitlines() if line.startswith("pdctl_kv_events_total")]
    print("gateway pdctl_kv_events_total:\n  " + "\n  ".join(kv))
    return 0 if quiet.failed == hostile.failed == after.failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
