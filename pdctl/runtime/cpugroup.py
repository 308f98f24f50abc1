"""Take an idle engine's spinning thread out of the competition for a core with other sessions' work (docs/cpu.md,
"Idle engines").

``SCHED_IDLE`` ranks a thread only against the threads of its own scheduling group. With
``kernel.sched_autogroup_enabled = 1`` and the process in the root cpu cgroup, each session is a group of its own
(pdctl starts every worker with ``setsid``), and the kernel shares a core between the groups first: a SCHED_IDLE
thread alone in its engine's group still gets a whole group's fair share against a loop in another session. Two
ways out, the first that works (``[supervisor] idle_group``):

- ``cgroup``: the cgroup v1 ``cpu`` hierarchy is writable (root): the thread alone moves into :data:`IDLE_CGROUP`
  under its root, with ``cpu.idle = 1`` (``cpu.shares = 2`` on a kernel before 5.15), while no engine serves, and
  back into the root cgroup (its autogroup) when one does (:func:`move_threads` both ways). A task
  outside the root cpu cgroup has no autogroup, and an idle group runs only when nothing else wants the core. The
  engine's other threads stay in their autogroup.
- ``autogroup``: ``/proc/PID/autogroup`` (any user may lower a nice): the engine's session group gets nice 19 (weight
  15 against nice 0's 1024) while no engine serves, and its nice back when one does
  (:func:`set_autogroup_nice`).

Whether the engines serve is looked at often by :class:`FollowLoop`, from their main threads' CPU time
(:class:`~pdctl.runtime.idle_threads.ActivityWatch`); every engine's threads go back while any of the deployment's
engines serves.

Neither applies on a cgroup v2 system with the cpu controller on (systemd distributions): there each session's
processes share their unit's cgroup, no autogroup, and SCHED_IDLE alone ranks the thread below that cgroup's work.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pdctl.runtime.idle_threads import FOLLOW_S, ActivityWatch

__all__ = [
    "AUTOGROUP_IDLE_NICE",
    "IDLE_CGROUP",
    "RESYNC_S",
    "FollowLoop",
    "GroupFollower",
    "autogroup_nice",
    "cpu_cgroup_root",
    "idle_cgroup",
    "move_threads",
    "set_autogroup_nice",
    "take_out",
]

#: The cgroup (under the cpu hierarchy's root) that holds idled threads of every deployment on the host.
IDLE_CGROUP = "pdctl-idle"
#: An idle engine's autogroup nice: the lowest weight an autogroup can have.
AUTOGROUP_IDLE_NICE = 19
#: How often the threads are written into the cgroup they should be in even without a change.
RESYNC_S = 1.0


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


@dataclass
class GroupFollower:
    """One engine's spinning threads, out of their session's group while no engine of the deployment serves.

    :class:`FollowLoop` decides, from every engine's :attr:`activity`: in the idle cgroup (or at the low weight) the
    thread does not run while anything else wants its core, and the engines' KV transfers need it (measured:
    docs/cpu.md).
    """

    activity: ActivityWatch
    cgroup: tuple[Path, Path, tuple[int, ...]] | None = None
    """``(idle cgroup, root cgroup, tids)``: the threads are in the idle cgroup while they are out."""
    autogroup: tuple[int, int] | None = None
    """``(pid, nice before)`` of the session autogroup lowered while the threads are out."""
    low: bool | None = None
    """Whether the threads are out now (None before the first look)."""
    synced_at: float = -math.inf

    def apply(self, now: float, serving: bool) -> None:
        """Out or back at ``now`` (monotonic seconds) as ``serving`` says (whether the deployment serves)."""
        low = not serving
        done = True
        if self.cgroup is not None and (low != self.low or now - self.synced_at >= RESYNC_S):
            group, root, tids = self.cgroup
            move_threads(tids, group if low else root)  # also now and then: undoes a move by hand
            self.synced_at = now
        if self.autogroup is not None and low != self.low:
            pid, nice = self.autogroup
            done = set_autogroup_nice(pid, AUTOGROUP_IDLE_NICE if low else nice)
        if done:
            self.low = low


class FollowLoop:
    """A thread that looks at every engine's activity each :data:`~pdctl.runtime.idle_threads.FOLLOW_S` (the
    supervisor's own loop looks every 2 s: too late for a request that needs the transfer threads) and takes every
    :class:`GroupFollower`'s threads back while any engine of the deployment serves, out when none does."""

    def __init__(self, followers: Callable[[], Iterable[GroupFollower | None]]) -> None:
        self._followers = followers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ensure_started(self) -> None:
        """Start the thread, once."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdctl-idle-group", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(FOLLOW_S):
            now = time.monotonic()
            followers = [f for f in self._followers() if f is not None]
            # Every engine back when any serves: a request shows on prefill first, and decode's transfer thread
            # is wanted as soon as prefill is done, before decode's own threads have run a look's worth.
            looks = [f.activity.serving(now) for f in followers]  # each watch looks, every time
            serving = any(looks)
            for follower in followers:
                follower.apply(now, serving)

    def stop(self) -> None:
        """Stop the thread (the threads stay where its last look put them)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)


def take_out(mode: str, threads: list[tuple[int, int]], activity: ActivityWatch) -> tuple[GroupFollower | None, str]:
    """Take ``(pid, tid)`` spinning threads out of their session's group by ``[supervisor] idle_group`` ``mode``:
    the follower that keeps them out while no engine serves, by ``activity`` (None: nothing done), and
    what was done, as the end of the supervisor's event sentence ("" for nothing)."""
    now = time.monotonic()
    if mode in ("auto", "cgroup"):
        root = cpu_cgroup_root()
        group = idle_cgroup(root)
        if root is not None and group is not None and move_threads([tid for _, tid in threads], group):
            follower = GroupFollower(activity, cgroup=(group, root, tuple(tid for _, tid in threads)))
            follower.apply(now, serving=False)
            return (
                follower,
                f", and moves them into the idle cpu cgroup {group} while the deployment is idle "
                "([supervisor] idle_group)",
            )
    if mode in ("auto", "autogroup"):
        pid = threads[0][0]
        nice = autogroup_nice(pid)
        if nice is not None:
            follower = GroupFollower(activity, autogroup=(pid, nice))
            follower.apply(now, serving=False)
            return (
                follower,
                f", and its session's autogroup goes to nice {AUTOGROUP_IDLE_NICE} while the deployment is idle "
                "([supervisor] idle_group)",
            )
    missing = {"off": "", "cgroup": "no writable cgroup v1 cpu hierarchy (root only)", "autogroup": "no autogroup"}
    found = missing.get(mode, "neither a writable cgroup v1 cpu hierarchy nor an autogroup")
    return None, found and f"; [supervisor] idle_group = {mode!r}: {found} here, so SCHED_IDLE alone"
