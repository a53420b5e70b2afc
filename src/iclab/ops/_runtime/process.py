"""A worker process that dies with its parent (Linux's ``PR_SET_PDEATHSIG``), for the sweep's process pools."""

from __future__ import annotations

import ctypes
import signal

__all__ = ["die_with_parent"]


def die_with_parent() -> bool:
    """Asks the kernel to SIGKILL this process when its parent dies (a killed sweep leaves no orphan computing).

    Returns:
        True where the kernel accepted it (Linux), False elsewhere.
    """
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False
