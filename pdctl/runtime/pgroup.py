"""Signalling a whole process group, where "already gone" is not an error (standard library only).

Every process pdctl starts leads its own group; stopping it means signalling the group. One helper for
``process.ManagedProcess``, the watchdog (which must import nothing heavy) and the test helpers.
"""

from __future__ import annotations

import errno
import os

__all__ = ["signal_group"]


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False when the group is gone (ESRCH) or not ours (EPERM)."""
    try:
        os.killpg(pgid, sig)
    except OSError as exc:
        if exc.errno in (errno.ESRCH, errno.EPERM):
            return False
        raise
    return True
