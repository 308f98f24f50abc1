"""Take an idle engine's spinning thread out of the competition for a core with other sessions' work (docs/cpu.md,
"Idle engines").

``SCHED_IDLE`` ranks a thread only against the threads of its own scheduling group. With
``kernel.sched_autogroup_enabled = 1`` and the process in the root cpu cgroup, each session is a group of its own
(pdctl starts every worker with ``setsid``), and the kernel shares a core between the groups first: a SCHED_IDLE
thread alone in its engine's group still gets a whole group's fair share against a loop in another session. Two
ways out, the first that works (``[supervisor] idle_group``):

- ``cgroup``: the cgroup v1 ``cpu`` hierarchy is writable (root): the thread alone moves into :data:`IDLE_CGROUP`
  under its root, with ``cpu.idle = 1`` (``cpu.shares = 2`` on a kernel before 5.15), while the engine has no
  request, and back into the root cgroup (its autogroup) when it has one (:func:`move_threads` both ways). A task
  outside the root cpu cgroup has no autogroup, and an idle group runs only when nothing else wants the core. The
  engine's other threads stay in their autogroup.
- ``autogroup``: ``/proc/PID/autogroup`` (any user may lower a nice): the engine's session group gets nice 19 (weight
  15 against nice 0's 1024) while the engine has no request, and its nice back when it has one (the supervisor's
  next look, :func:`set_autogroup_nice`).

Neither applies on a cgroup v2 system with the cpu controller on (systemd distributions): there each session's
processes share their unit's cgroup, no autogroup, and SCHED_IDLE alone ranks the thread below that cgroup's work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

__all__ = [
    "AUTOGROUP_IDLE_NICE",
    "IDLE_CGROUP",
    "autogroup_nice",
    "cpu_cgroup_root",
    "idle_cgroup",
    "move_threads",
    "set_autogroup_nice",
]

#: The cgroup (under the cpu hierarchy's root) that holds idled threads of every deployment on the host.
IDLE_CGROUP = "pdctl-idle"
#: An idle engine's autogroup nice: the lowest weight an autogroup can have.
AUTOGROUP_IDLE_NICE = 19


def cpu_cgroup_root(mounts: Path = Path("/proc/self/mounts")) -> Path | None:
    """The mount point of the cgroup v1 hierarchy with the ``cpu`` controller, if this process may move tasks in
    it (its ``tasks`` file is writable); None on cgroup v2 only, or without the right."""
    try:
        lines = mounts.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup" and "cpu" in fields[3].split(","):
            root = Path(fields[1])
            with contextlib.suppress(OSError):
                (root / "tasks").open("a").close()
                return root
    return None


def idle_cgroup(root: Path | None) -> Path | None:
    """:data:`IDLE_CGROUP` under ``root``, created on first use and made idle; None if that fails."""
    if root is None:
        return None
    group = root / IDLE_CGROUP
    try:
        group.mkdir(exist_ok=True)
        if (group / "cpu.idle").exists():
            (group / "cpu.idle").write_text("1")
        else:
            (group / "cpu.shares").write_text("2")
    except OSError:
        return None
    return group


def move_threads(tids: Iterable[int], group: Path) -> list[int]:
    """Move each thread alone (not its process) into ``group``; returns those moved (one gone is skipped)."""
    moved = []
    for tid in tids:
        try:
            (group / "tasks").write_text(str(tid))
        except OSError:
            continue
        moved.append(tid)
    return moved


def autogroup_nice(pid: int) -> int | None:
    """The nice of ``pid``'s session autogroup; None when autogroups do not apply to it (turned off, no such
    kernel option, or the process in a cpu cgroup other than the root, where the kernel ignores its autogroup)."""
    try:
        if Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() != "1":
            return None
        v1_cpu, v2_path = False, "/"
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                v1_cpu = True
                if path != "/":
                    return None
            elif not controllers:
                v2_path = path
        if not v1_cpu and v2_path != "/" and "cpu" in _v2_root_controllers():
            return None
        # "/autogroup-6167 nice 0"
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Set the nice of ``pid``'s session autogroup; False when the kernel refused it (an unprivileged writer is held
    to one write in 100 ms on the whole host: EAGAIN, tried again at the next look) or the process is gone."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
    except OSError:
        return False
    return True


def _v2_root_controllers() -> list[str]:
    try:
        return Path("/sys/fs/cgroup/cgroup.subtree_control").read_text().split()
    except OSError:
        return []
