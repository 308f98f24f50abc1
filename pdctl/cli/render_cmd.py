"""``pdctl render k8s``: the two files as Kubernetes manifests (``kubectl apply -k DIR`` or ``-f -``);
``pdctl render compose``: the same as Docker Compose files, one per host;
``pdctl render monitoring``: Prometheus scrape config, rules and a Grafana dashboard for the same processes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer

from pdctl import config
from pdctl.check import Finding
from pdctl.cli._app import app, console, err_console, handle_errors
from pdctl.cli.config_cmds import ConfigOpt, SettingsOpt, render_findings
from pdctl.errors import PdctlError

render_app = typer.Typer(
    no_args_is_help=True, help="Export the deployment to other tools (Kubernetes, Docker Compose, Prometheus, Grafana)."
)
app.add_typer(render_app, name="render")


# The options `render k8s` and `render compose` share.
ImageOpt = Annotated[str | None, typer.Option(help="vLLM image (default: vllm/vllm-openai at pdctl's vLLM).")]
PdctlImageOpt = Annotated[str | None, typer.Option(help="Image with pdctl (gateway, verify, sim).")]
UcxTlsOpt = Annotated[str | None, typer.Option(help="UCX_TLS of every worker, e.g. rc,cuda_copy.")]
UcxNetDevicesOpt = Annotated[str | None, typer.Option(help="UCX_NET_DEVICES, e.g. mlx5_0:1.")]


def _write_and_show(
    findings: Sequence[Finding], can_write: bool, write: Callable[[], list[Path]], steps: Callable[[], list[str]]
) -> None:
    """Print the findings; exit 2 when an error left nothing to write; else write, then print the paths and the
    commands that come next."""
    if findings:
        render_findings(list(findings))
    if not can_write:
        raise typer.Exit(2)
    for path in write():
        console.print(f"wrote {path}", markup=False)
    console.print("next:")
    for step in steps():
        console.print(f"  {step}", markup=False)


@render_app.command("k8s")
@handle_errors
def k8s(
    config_path: ConfigOpt = Path(config.DEFAULT_CONFIG),
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    out: Annotated[str, typer.Option("-o", "--out", help="Folder to write, or - for one YAML stream.")] = "k8s",
    namespace: Annotated[str | None, typer.Option(help="Namespace (default: [cluster] name).")] = None,
    image: ImageOpt = None,
    pdctl_image: PdctlImageOpt = None,
    secret: Annotated[str, typer.Option(help="Secret holding the keys, one entry per variable.")] = "pdctl-keys",
    ucx_tls: UcxTlsOpt = None,
    ucx_net_devices: UcxNetDevicesOpt = None,
    rdma_resource: Annotated[
        list[str] | None, typer.Option(help="Per-pod RDMA resource NAME=COUNT (adds IPC_LOCK), e.g. rdma/ib=1.")
    ] = None,
    shm_size: Annotated[str, typer.Option(help="/dev/shm size of TP>1 pods.")] = "16Gi",
    pod_monitor: Annotated[
        bool, typer.Option("--pod-monitor", help="Also PodMonitors for the Prometheus Operator (its CRDs must exist).")
    ] = False,
    autoscale: Annotated[
        Path | None, typer.Option("--autoscale", help="Also KEDA ScaledObjects from `pdctl advise --json`'s file.")
    ] = None,
    prometheus: Annotated[str | None, typer.Option(help="Prometheus URL the ScaledObjects query.")] = None,
    autoscaler: Annotated[
        str, typer.Option(help="With --autoscale: keda (ScaledObjects) or hpa (HPAs on prometheus-adapter's metrics).")
    ] = "keda",
) -> None:
    """Write namespace, ConfigMap, per-group StatefulSet + headless Service, gateway and verify Job manifests.

    The vLLM command lines and environment are `pdctl plan`'s. Keys are read from a Secret you create
    (the command is printed); none is ever written.
    """
    from pdctl.render.k8s import K8sOptions, dump_yaml, next_steps, render, write

    options = K8sOptions(
        namespace=namespace,
        image=image,
        secret=secret,
        ucx_tls=ucx_tls,
        ucx_net_devices=ucx_net_devices,
        rdma_resources=tuple(rdma_resource or ()),
        shm_size=shm_size,
        pod_monitor=pod_monitor,
        **({"pdctl_image": pdctl_image} if pdctl_image else {}),
    )
    dep = config.load(config_path, settings_path)
    rendered = render(dep, options)
    if autoscale is not None:
        from pdctl.render.autoscale import DEFAULT_PROMETHEUS, load_plan, with_autoscaling

        if autoscaler not in ("keda", "hpa"):
            raise PdctlError(f"--autoscaler {autoscaler!r}: keda or hpa")
        rendered = with_autoscaling(rendered, dep, load_plan(autoscale), prometheus or DEFAULT_PROMETHEUS,
                                    "hpa" if autoscaler == "hpa" else "keda")  # fmt: skip
    if out == "-" and rendered.files:
        for f in rendered.findings:  # stdout carries the YAML
            where = f.file + (f":{f.line}" if f.line else "") + (f" {f.key}" if f.key else "")
            err_console.print(f"{f.code} {f.severity}: {where}: {f.message}", markup=False)
        typer.echo(dump_yaml(rendered.manifests), nl=False)
        return
    _write_and_show(
        rendered.findings, bool(rendered.files), lambda: write(rendered, Path(out)),
        lambda: next_steps(dep, rendered, out, options),
    )  # fmt: skip


@render_app.command("compose")
@handle_errors
def compose(
    config_path: ConfigOpt = Path(config.DEFAULT_CONFIG),
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    out: Annotated[str, typer.Option("-o", "--out", help="Folder to write.")] = "compose",
    image: ImageOpt = None,
    pdctl_image: PdctlImageOpt = None,
    env_file: Annotated[
        str, typer.Option(help="The file you create with the keys (VAR=value lines), relative to the compose file.")
    ] = "pdctl.env",
    ucx_tls: UcxTlsOpt = None,
    ucx_net_devices: UcxNetDevicesOpt = None,
) -> None:
    """Write compose.yaml (one host) or compose.HOST.yaml per host: workers, gateway, and a verify service.

    Host networking; the vLLM command lines and environment are `pdctl plan`'s. Keys are read from an env file
    you create (the command is printed); none is ever written.
    """
    from pdctl.render.compose import ComposeOptions, next_steps, render, write

    options = ComposeOptions(
        image=image,
        env_file=env_file,
        ucx_tls=ucx_tls,
        ucx_net_devices=ucx_net_devices,
        **({"pdctl_image": pdctl_image} if pdctl_image else {}),
    )
    dep = config.load(config_path, settings_path)
    rendered = render(dep, options, Path(out))
    _write_and_show(
        rendered.findings, bool(rendered.files), lambda: write(rendered, Path(out)),
        lambda: next_steps(dep, rendered, out, options),
    )  # fmt: skip


@render_app.command("monitoring")
@handle_errors
def monitoring(
    config_path: ConfigOpt = Path(config.DEFAULT_CONFIG),
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    out: Annotated[str, typer.Option("-o", "--out", help="Folder to write.")] = "monitoring",
    scrape_interval: Annotated[int, typer.Option(min=1, help="Seconds between scrapes.")] = 15,
    evaluation_interval: Annotated[int, typer.Option(min=1, help="Seconds between rule evaluations.")] = 15,
    file_sd: Annotated[
        bool, typer.Option("--file-sd", help="prometheus.yml reads the targets from targets/*.json (file_sd).")
    ] = False,
    runbook: Annotated[str, typer.Option(help="The page each alert's runbook links to (#<alert> appended).")] = (
        "docs/troubleshooting.md"
    ),
) -> None:
    """Write prometheus.yml, recording and alert rules, file_sd targets and a Grafana dashboard.

    Targets are `pdctl plan`'s processes, labelled role, instance (the process name) and deployment ([cluster]
    name). Check them with `promtool check config DIR/prometheus.yml`.
    """
    from pdctl.render.monitoring import MonitoringOptions, render, write

    options = MonitoringOptions(
        scrape_interval_s=scrape_interval, evaluation_interval_s=evaluation_interval, file_sd=file_sd, runbook=runbook
    )
    rendered = render(config.load(config_path, settings_path), options)
    for path in write(rendered, Path(out)):
        console.print(f"wrote {path}", markup=False)
    for note in rendered.notes:
        err_console.print(f"note: {note}", markup=False)
    console.print("next:")
    console.print(f"  promtool check config {Path(out) / 'prometheus.yml'}", markup=False)
    console.print(
        f"  prometheus --config.file={Path(out) / 'prometheus.yml'} --storage.tsdb.path=DATA_DIR", markup=False
    )
    console.print(
        f"  import {Path(out) / 'grafana' / 'pdctl.json'} in Grafana (Dashboards > New > Import)", markup=False
    )


@render_app.command("vllm-router")
@handle_errors
def vllm_router(
    config_path: ConfigOpt = Path(config.DEFAULT_CONFIG),
    settings_path: SettingsOpt = Path(config.DEFAULT_SETTINGS),
    k8s: Annotated[bool, typer.Option("--k8s", help="Workers by the Service names `render k8s` gives them.")] = False,
) -> None:
    """Print a vllm-router command line (PD mode, static workers) for the same prefill and decode instances."""
    import shlex

    from pdctl.render.peers import vllm_router_argv

    typer.echo(shlex.join(vllm_router_argv(config.load(config_path, settings_path), cluster=k8s)))
