"""Pods on loopback behind a DNS server: the rendered gateway discovers the rendered worker pods while they scale.

Every process runs a rendered container's command, args and environment (``pdctl render k8s``), each on its own
loopback address as pod IP; ``tests/fakes/dns_server.py`` serves the headless Services' A records, and the
gateway container reads them through ``PDCTL_DNS_SERVER``. While clients send requests, decode scales 1 -> 2
and prefill 2 -> 1 the way Kubernetes does it (a new pod starts, then joins the Service's records; a leaving
pod leaves the records, drains, then gets SIGTERM). Then N1-N3 must hold, nothing is lost, and the new decode
pod's first KV pull is the gateway's warm-up, not a client's request. Simulator engines.

Two deviations from a cluster, both from sharing one network namespace: ``--host 0.0.0.0`` (and the gateway's
``routing.kv_events_host``) becomes the pod's own address (two replicas share a port), and ``/etc/pdctl`` (the ConfigMap mount) becomes a folder of the test.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdctl import config
from pdctl.gateway.discovery import DNS_SERVER_ENV
from pdctl.render.k8s import CONFIG_MOUNT, dump_yaml, render
from pdctl.testing.invariants import (
    ClientTally,
    check_n1,
    check_n2,
    check_n3,
    client_outcome,
    decode_requests_from_log,
    gateway_outcomes,
)
from pdctl.testing.ports import free_port
from pdctl.testing.sim import SimProcess
from pdctl.vllm.promtext import metric_value, samples
from tests.conftest import REPO
from tests.fakes.dns_server import DnsServer
from tests.render.test_pods import start_pod, wait_healthy

KEY = "sk-pods-discovery-test"
GATEWAY_IP = "127.0.0.6"
PROMPT = "pods behind a headless Service " * 12


def _config(folder: Path, replicas: tuple[int, int] = (2, 1), **routing: Any) -> Path:
    ports = {role: (free_port(), free_port()) for role in ("prefill", "decode")}
    (folder / "config.toml").write_text(
        '[cluster]\nname = "pods"\n'
        + "".join(
            f'[{role}]\nmodel = "sim-model"\nengine = "sim"\nside_channel_port = {ports[role][1]}\nreplicas = {n}\n'
            for role, n in zip(("prefill", "decode"), replicas, strict=True)
        )
        + '[sim]\nprofile = "fast"\nspeed = 20\n',
        encoding="utf-8",
    )
    settings = {
        "gateway": {"listen": f"127.0.0.1:{free_port()}", "request_timeout_s": 60},
        "routing": {**{f"{r}_endpoint": f"http://127.0.0.1:{p[0]}" for r, p in ports.items()}, **routing},
        "logging": {"level": "debug"},
    }
    (folder / "settings.json").write_text(json.dumps(settings), encoding="utf-8")
    return folder


class Cluster:
    """The rendered objects, and the pods started from them."""

    def __init__(self, dep: config.Deployment, folder: Path) -> None:
        docs = [d for d in yaml.safe_load_all(dump_yaml(render(dep).manifests)) if d]
        self.containers = {
            d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0]
            for d in docs
            if d["kind"] in ("StatefulSet", "Deployment")
        }
        self.files = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
        self.folder = folder
        self.pods: dict[str, SimProcess] = {}
        self.gateway: subprocess.Popen[bytes] | None = None

    def start_worker(self, group: str, pod_ip: str) -> str:
        container = dict(self.containers[group])
        args = list(container["args"])
        args[args.index("--host") + 1] = pod_ip
        args = [a.replace('"tcp://gateway:', f'"tcp://{GATEWAY_IP}:') for a in args]  # the gateway Service's name
        container["args"] = args
        pod = start_pod(container, pod_ip, self.folder / f"{group}@{pod_ip}.log")
        self.pods[pod_ip] = pod
        url = f"http://{pod_ip}:{pod.port}"
        wait_healthy(pod, url, 60.0)
        return url

    def start_gateway(self, dns_address: str) -> str:
        mount = self.folder / "etc-pdctl"
        mount.mkdir()
        for name, text in self.files.items():
            # the KV events port listens on the pod IP, as --host does (0.0.0.0 in a pod of its own)
            text = text.replace('"kv_events_host": "0.0.0.0"', f'"kv_events_host": "{GATEWAY_IP}"')
            (mount / name).write_text(text, encoding="utf-8")
        c = self.containers["gateway"]
        argv = [a.replace(CONFIG_MOUNT, str(mount)) for a in c["command"] + c["args"]]
        argv[argv.index("--host") + 1] = GATEWAY_IP
        assert argv[0] == "pdctl"
        argv = [sys.executable, "-m", "pdctl", *argv[1:]]
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO),
               "HOME": str(self.folder), DNS_SERVER_ENV: dns_address}  # fmt: skip
        for e in c["env"]:
            env[e["name"]] = e["value"] if "value" in e else KEY  # the Secret's key
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "http")
        with (self.folder / "gateway.log").open("wb") as out:
            self.gateway = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return f"http://{GATEWAY_IP}:{port}"

    def stop_worker(self, pod_ip: str) -> None:
        self.pods[pod_ip].stop(grace_s=30.0)

    def close(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.gateway.wait(30)
            if self.gateway.poll() is None:
                self.gateway.kill()
                self.gateway.wait()
        for pod in self.pods.values():
            pod.stop(grace_s=30.0)

    def gateway_log(self) -> str:
        return (self.folder / "gateway.log").read_text(errors="replace")


def _instances(gw: str) -> dict[str, str]:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        return {i["name"]: i["state"] for i in httpx.get(f"{gw}/ready", timeout=2.0).json()["instances"]}
    return {}


def _wait_for(what: str, predicate: Any, cluster: Cluster, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        assert cluster.gateway is None or cluster.gateway.poll() is None, cluster.gateway_log()[-3000:]
        time.sleep(0.2)
    pytest.fail(f"{what} within {timeout_s} s; gateway log:\n{cluster.gateway_log()[-3000:]}")


class Traffic:
    """Clients sending requests (streamed and not) until stopped; each outcome recorded for N1."""

    def __init__(self, gw: str, clients: int = 3) -> None:
        self.gw = gw
        self.tally = ClientTally()
        self.decoded_by: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._n = 0
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def answered(self) -> int:
        """How many requests have been answered so far."""
        with self._lock:
            return sum(self.decoded_by.values())

    def _client(self, index: int) -> None:
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.Client(timeout=120.0) as client:
            while not self._stop.is_set():
                with self._lock:
                    self._n += 1
                    rid = f"pods-{self._n}"
                stream = self._n % 2 == 0
                body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8, "stream": stream}
                r = client.post(f"{self.gw}/v1/completions", json=body, headers={**headers, "x-request-id": rid})
                with self._lock:
                    self.tally.record(client_outcome(r.status_code, r.content, stream=stream), rid)
                    self.decoded_by[r.headers.get("x-pd-decode", "-")] += 1


def test_pods_scale_behind_dns_and_nothing_is_lost(tmp_path: Path) -> None:
    dep = config.load(*(_config(tmp_path) / n for n in ("config.toml", "settings.json")))
    cluster = Cluster(dep, tmp_path)
    with DnsServer({"prefill": ["127.0.0.2", "127.0.0.4"], "decode": ["127.0.0.3"]}) as dns:
        try:
            urls = {ip: cluster.start_worker(g, ip) for g, ip in
                    (("prefill", "127.0.0.2"), ("prefill", "127.0.0.4"), ("decode", "127.0.0.3"))}  # fmt: skip
            gw = cluster.start_gateway(dns.address)
            _wait_for("three serving instances", lambda: set(_instances(gw).values()) == {"serving"}
                      and len(_instances(gw)) == 3, cluster)  # fmt: skip
            with Traffic(gw) as traffic:
                _wait_for("three requests answered", lambda: traffic.answered() >= 3, cluster)
                # decode 1 -> 2: the pod starts, then the Service lists it.
                urls["127.0.0.5"] = cluster.start_worker("decode", "127.0.0.5")
                dns.set("decode", ["127.0.0.3", "127.0.0.5"])
                _wait_for("decode@127.0.0.5 serving", lambda: _instances(gw).get("decode@127.0.0.5") == "serving",
                          cluster)  # fmt: skip
                _wait_for("a request decoded by decode@127.0.0.5",
                          lambda: traffic.decoded_by["decode@127.0.0.5"] > 0, cluster)  # fmt: skip
                # prefill 2 -> 1: the Service drops the pod, the gateway drains it, the pod drains and stops.
                dns.set("prefill", ["127.0.0.2"])
                _wait_for("prefill@127.0.0.4 drained and removed", lambda: "prefill@127.0.0.4" not in _instances(gw),
                          cluster)  # fmt: skip
                leaving = urls.pop("127.0.0.4")
                assert check_n2({"prefill@127.0.0.4": leaving}, timeout_s=10).ok
                cluster.stop_worker("127.0.0.4")
                left = traffic.answered()
                _wait_for("three requests answered after prefill@127.0.0.4 left",
                          lambda: traffic.answered() >= left + 3, cluster)  # fmt: skip
            # The rendered gateway listens beyond loopback, so /metrics wants a client key there.
            metrics = httpx.get(f"{gw}/metrics", headers={"authorization": f"Bearer {KEY}"}, timeout=5.0).text
            n1 = check_n1(gateway_outcomes(metrics), traffic.tally)
            n2 = check_n2(urls, timeout_s=10)
            decode_logs = {ip: cluster.pods[ip].output().splitlines() for ip in ("127.0.0.3", "127.0.0.5")}
            counts: Counter[str] = Counter()
            for lines in decode_logs.values():
                counts.update(decode_requests_from_log(lines))
            parsed = samples(metrics, ["pdctl_retries", "pdctl_instances"])
            n3 = check_n3(counts, retries=metric_value(parsed, "pdctl_retries_total") or 0.0)
        finally:
            cluster.close()
    assert n1.ok and n2.ok and n3.ok, (n1, n2, n3)
    assert not n3.skipped
    # Nothing lost: every request a client sent succeeded (at least 3 + 1 + 3 of them were answered above).
    assert traffic.tally.sent >= 7 and traffic.tally.succeeded == traffic.tally.sent, traffic.tally
    # The new decode got client traffic, and only after its warm-up: its first KV pull is the warm-up's.
    new_pod = list(decode_requests_from_log(decode_logs["127.0.0.5"]))
    assert new_pod[0].startswith("pdctl-warmup-"), new_pod[:3]
    assert traffic.decoded_by["decode@127.0.0.5"] > 0 and any(r.startswith("pods-") for r in new_pod)
    # /metrics shows the instance set as it ends.
    assert metric_value(parsed, "pdctl_instances", role="decode", state="serving") == 2
    assert metric_value(parsed, "pdctl_instances", role="prefill", state="serving") == 1
    assert metric_value(parsed, "pdctl_instances", role="prefill", state="draining") == 0


def test_each_pod_of_a_group_publishes_its_kv_events_under_its_discovered_name(tmp_path: Path) -> None:
    """``prefix_view = "exact"`` with two decode pods behind one Service: each pod's events arrive under the name
    discovery gives it (``decode@<pod IP>``), so ``kv_aware`` tells their caches apart and a prompt's next turn
    goes to the pod holding it."""
    folder = _config(tmp_path, (1, 2), prefix_view="exact", decode_policy="kv_aware", kv_events_port=free_port())
    dep = config.load(folder / "config.toml", folder / "settings.json")
    cluster = Cluster(dep, tmp_path)
    pods = ("decode@127.0.0.3", "decode@127.0.0.5")
    with DnsServer({"prefill": ["127.0.0.2"], "decode": ["127.0.0.3", "127.0.0.5"]}) as dns:
        try:
            for group, ip in (("prefill", "127.0.0.2"), ("decode", "127.0.0.3"), ("decode", "127.0.0.5")):
                cluster.start_worker(group, ip)
            gw = cluster.start_gateway(dns.address)
            headers = {"authorization": f"Bearer {KEY}"}

            def events(metrics: str) -> dict[str, float]:
                parsed = samples(metrics, ["pdctl_kv_events"])
                return {p: metric_value(parsed, "pdctl_kv_events_total", instance=p, event="BlockStored") or 0.0
                        for p in pods}  # fmt: skip

            def metrics() -> str:
                return httpx.get(f"{gw}/metrics", headers=headers, timeout=5.0).text

            _wait_for("three serving instances", lambda: set(_instances(gw).values()) == {"serving"}
                      and len(_instances(gw)) == 3, cluster)  # fmt: skip
            history = "a conversation held by one decode pod, " * 40
            before = events(metrics())
            with httpx.Client(timeout=60.0) as client:
                first = client.post(f"{gw}/v1/completions", headers=headers,
                                    json={"model": "sim-model", "prompt": history, "max_tokens": 4})  # fmt: skip
                assert first.status_code == 200, first.text
                holder = first.headers["x-pd-decode"]
                _wait_for(f"{holder}'s events for the first turn",
                          lambda: events(metrics())[holder] > before[holder], cluster)  # fmt: skip
                nxt = client.post(f"{gw}/v1/completions", headers=headers,
                                  json={"model": "sim-model", "prompt": history + "And then?", "max_tokens": 4})  # fmt: skip
                assert nxt.status_code == 200, nxt.text
        finally:
            cluster.close()
    assert nxt.headers["x-pd-decode"] == holder
    picks = [line for line in cluster.gateway_log().splitlines() if "decode_pick=kv_aware:" in line]
    assert picks and "decode_pick=kv_aware:cost" in picks[-1], picks[-1:]  # chosen by its cost, not a tie
    scores = dict(x.split(":") for x in picks[-1].split("decode_scores=")[1].split()[0].split(","))
    assert set(scores) == set(pods) and scores[holder] < max(scores.values()), scores
