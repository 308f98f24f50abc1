"""``pdctl top``: the deployment's workers and gateway, live, redrawn every second (data: :mod:`pdctl.runtime.top`)."""

from __future__ import annotations

import math
import os
import select
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from pdctl.cli._app import app, console, handle_errors
from pdctl.cli.run_cmds import ConfigOpt, SettingsOpt
from pdctl.config import DEFAULT_CONFIG, DEFAULT_SETTINGS, load
from pdctl.errors import PdctlError

if TYPE_CHECKING:
    from rich.console import RenderableType

    from pdctl.runtime.top import Advice, GatewayView, TopView, WorkerRow


class _Keys:
    """``q`` from the terminal: stdin in cbreak mode (keys arrive unbuffered, Ctrl-C still interrupts) while
    ``top`` runs, restored on exit. When stdin is not a terminal, only the wait remains."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self._saved: list[Any] | None = None

    def __enter__(self) -> _Keys:
        if sys.stdin.isatty():
            import termios
            import tty

            self.fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and self._saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def quit_within(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True as soon as ``q`` is pressed."""
        deadline = time.monotonic() + max(seconds, 0.0)
        while True:
            left = deadline - time.monotonic()
            if self.fd is None:
                time.sleep(max(left, 0.0))
                return False
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                data = os.read(self.fd, 64)
                if not data or b"q" in data.lower():
                    return True


def _num(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _worker_cells(r: WorkerRow) -> list[Text]:
    if r.down is None:
        state = Text("up", "green")
    else:
        state = Text("down" if r.down == "down" else f"down ({r.down})", "bold red")
    return [
        Text(r.name), Text(r.role), state, Text(_num(r.running)), Text(_num(r.waiting)),
        Text(_num(None if r.kv_usage is None else r.kv_usage * 100, "{:.1f}%")), Text(_num(r.prompt_tps, "{:.1f}")),
        Text(_num(r.generation_tps, "{:.1f}")), Text(_num(r.transfers_ps, "{:.2f}")),
    ]  # fmt: skip


def _breaks(breaks: dict[str, float]) -> str:
    """Agent sessions' cache breaks in the window, with where (``pdctl.gateway.agent_sessions``)."""
    seen = {k: v for k, v in sorted(breaks.items()) if v > 0}
    if not seen:
        return "  cache breaks 0"
    return f"  cache breaks {_num(sum(seen.values()))} (" + ", ".join(f"{k} {_num(v)}" for k, v in seen.items()) + ")"


def _predictor(predictor: dict[str, float | None]) -> str:
    """The SLO autopilot's error in the window: median observed / predicted (``pdctl.gateway.routing.autopilot``)."""
    if not predictor:
        return ""
    cells = [f"{what} {value:.2f}x" if value is not None else f"{what} -" for what, value in predictor.items()]
    return "  autopilot observed/predicted p50 " + " ".join(cells)


_ADVICE_STYLE = {"ok": "green", "over": "yellow", "idle": "dim"}
_ADVICE_WORDS = {
    "ok": "the SLO holds", "over": "fewer engines would do", "under_prefill": "prefill short for the TTFT SLO",
    "under_decode": "decode short for the TPOT SLO", "under_both": "prefill and decode short for the SLO",
    "unreachable": "no split meets the SLO", "idle": "too few requests to size",
}  # fmt: skip


def _advice(advice: Advice | None) -> Text | None:
    """The gateway's sizing advice (``slo.capacity_profile``): now -> recommended, with the predicted p90s."""
    if advice is None:
        return None

    def split(counts: tuple[int, int]) -> str:
        return f"{counts[0]}P{counts[1]}D"

    def pair(values: tuple[float | None, float | None], fmt: str) -> str:
        cells = ["-" if v is None else "inf" if math.isinf(v) else fmt.format(v * 1000) for v in values]
        return " -> ".join(cells) + " ms"

    style = _ADVICE_STYLE.get(advice.status, "bold red")
    return Text.assemble(
        ("advice ", "bold"), f"(last {advice.window}, {advice.rate:.2f} req/s): ",
        (_ADVICE_WORDS.get(advice.status, advice.status), style),
        f"  {split(advice.current)} -> {split(advice.recommended)}",
        f"  TTFT p90 {pair(advice.ttft_p90, '{:.0f}')}  TPOT p90 {pair(advice.tpot_p90, '{:.1f}')}",
    )  # fmt: skip


def _gateway_part(gw: GatewayView, slo_ms: tuple[float, float], key_var: str) -> RenderableType:
    if gw.down is not None:
        hint = f": set ${key_var}" if gw.down in ("HTTP 401", "HTTP 403") else ""
        state = "down" if gw.down == "down" else f"down ({gw.down}{hint})"
        return Text.assemble(("gateway ", "bold"), gw.url, "  ", (state, "bold red"))
    head = Text.assemble(
        ("gateway ", "bold"), gw.url, "  ", ("up", "green"), f"  in flight {_num(gw.in_flight)}",
        f"  last {gw.window_s:.0f} s: fallbacks {_num(gw.fallbacks)}", _breaks(gw.cache_breaks),
        _predictor(gw.predictor),
    )  # fmt: skip
    table = Table(box=None, pad_edge=False, header_style="bold")
    quantiles = [f"p{q * 100:g}" for q in (gw.total.ttft if gw.total is not None else {})]
    for col in ("path", "requests", "req/s", "errors", *(f"{m} {q} ms" for m in ("TTFT", "TPOT") for q in quantiles)):
        table.add_column(col, justify="left" if col == "path" else "right")
    rows = [*gw.paths, *([gw.total] if gw.total is not None else [])]
    for row in rows:
        latency = []
        for hist, slo in ((row.ttft, slo_ms[0]), (row.tpot, slo_ms[1])):
            for q, value in hist.items():
                over = q == 0.9 and value is not None and value * 1000 > slo
                latency.append(Text(_ms(value), "red" if over else ""))
        rate = row.requests / gw.window_s if gw.window_s > 0 else None
        table.add_row(
            Text(row.path, "bold" if row is gw.total else ""), Text(_num(row.requests)), Text(_num(rate, "{:.2f}")),
            Text(_num(row.errors), "red" if row.errors else ""), *latency,
        )  # fmt: skip
    advice = _advice(gw.advice)
    return Group(head, table) if advice is None else Group(head, advice, table)


def render(view: TopView, source: str, slo_ms: tuple[float, float], key_var: str, keys: bool) -> RenderableType:
    """One screen: a title line, the workers' table, the gateway's last minute."""
    title = Text.assemble(
        ("pdctl top", "bold"), f"  {source}  {datetime.now():%H:%M:%S}", ("  q: quit" if keys else "", "dim")
    )
    workers = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("worker", "role", "state", "running", "waiting", "KV cache", "prompt tok/s", "gen tok/s", "xfers/s"):
        workers.add_column(col, justify="left" if col in ("worker", "role", "state") else "right")
    for row in view.workers:
        workers.add_row(*_worker_cells(row))
    return Group(title, Text(""), workers, Text(""), _gateway_part(view.gateway, slo_ms, key_var))


@app.command("top")
@handle_errors
def top(
    config: ConfigOpt = Path(DEFAULT_CONFIG),
    settings: SettingsOpt = Path(DEFAULT_SETTINGS),
    interval: Annotated[float, typer.Option("--interval", "-n", help="Seconds between refreshes.", min=0.2)] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame (two scrapes --interval apart), exit.")] = False,
) -> None:
    """Live view of a deployment: per worker running/waiting requests, KV cache usage, tokens/s and KV transfers/s;
    for the gateway, requests, errors and TTFT/TPOT per path over the last minute. ``q`` or Ctrl-C quits.

    The numbers come from each worker's and the gateway's ``/metrics`` (the gateway's with the key of
    ``gateway.api_key_env`` when that variable is set); an endpoint that does not answer shows as down.
    """
    from rich.live import Live

    from pdctl.runtime.top import Scraper, Watch, targets

    dep = load(config, settings)
    workers, gateway = targets(dep)
    if not workers:
        raise PdctlError(f"{config}: no workers to watch")
    key_var = dep.gateway.api_key_env
    slo_ms = (float(dep.slo.ttft_ms), float(dep.slo.tpot_ms))
    watch = Watch(workers, gateway)
    source = str(config)

    with Scraper(workers, gateway, api_key=os.environ.get(key_var) or None, timeout_s=max(interval, 1.0)) as scraper:
        if once:
            watch.add(scraper.scrape())
            time.sleep(interval)
            watch.add(scraper.scrape())
            console.print(render(watch.view(), source, slo_ms, key_var, keys=False))
            return
        with _Keys() as keys, Live(console=console, screen=console.is_terminal, auto_refresh=False) as live:
            while True:
                started = time.monotonic()
                watch.add(scraper.scrape())
                live.update(render(watch.view(), source, slo_ms, key_var, keys.fd is not None), refresh=True)
                if keys.quit_within(interval - (time.monotonic() - started)):
                    return
