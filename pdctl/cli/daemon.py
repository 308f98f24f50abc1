"""The detached supervisor's process: ``python -m pdctl.cli.daemon -c CONFIG -s SETTINGS [--only NAME|ROLE ...]``.

``pdctl up -d`` starts it in a new session (:func:`pdctl.runtime.control.start_detached`); it runs one
:class:`~pdctl.runtime.daemon.Runner` until SIGTERM/SIGINT (a second one skips the grace periods), explaining a
start that failed on a taken port with ``check``'s PD018 finding, and exits 0 (stopped), 1 (failed) or 2 (the
files are wrong: the error on stderr, which ``up -d`` relays).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from types import FrameType

from pdctl.check import port_taken_error
from pdctl.config import load
from pdctl.errors import PdctlError
from pdctl.runtime.control import host_part, split_only
from pdctl.runtime.daemon import Runner, error_text

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The detached supervisor: ``python -m pdctl.cli.daemon -c CONFIG -s SETTINGS [--only NAME|ROLE ...]``."""
    parser = argparse.ArgumentParser(prog="python -m pdctl.cli.daemon")
    parser.add_argument("-c", "--config", required=True)
    parser.add_argument("-s", "--settings", required=True)
    parser.add_argument("--only", action="append", default=[], help="this host's part (`pdctl up --only`)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        part = host_part(load(args.config, args.settings), split_only(args.only))
        runner = Runner(part.dep, part.plan, detached=True, remote=part.remote,
                        explain=lambda exc: port_taken_error(part.dep, exc))  # fmt: skip
    except PdctlError as exc:
        print(f"error: {error_text(exc)}", file=sys.stderr)
        return 2

    def handle(signum: int, frame: FrameType | None) -> None:
        runner.request_stop()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    try:
        runner.start()
    except PdctlError:
        return 1
    reason = runner.serve()
    runner.stop(reason)
    return 1 if reason else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
