"""In the runner: exit when the serve that started it dies, so that no runner holding gigabytes outlives it.

The parent (ollama_engine.llm.runner_handle) puts its pid in PARENT_PID_ENV, and says in
PARENT_DEATH_SIGNAL_ENV whether the kernel may signal the runner when the spawning thread ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

from ollama_engine import envconfig

PARENT_POLL_INTERVAL = 0.5  # seconds between the runner's looks at its parent pid
PR_SET_PDEATHSIG = 1


def watch_parent(interval: float = PARENT_POLL_INTERVAL) -> None:
    """In the runner: exit when the serve that started it dies, SIGKILL included, so that no runner holding
    gigabytes outlives its serve. Linux's parent-death signal (prctl PR_SET_PDEATHSIG, SIGTERM) acts at once;
    a thread watching os.getppid() (re-parented to init or a subreaper) is the fallback everywhere, and covers
    a parent that died before the prctl. Without PARENT_PID_ENV (a runner started by hand) nothing is watched."""
    parent = envconfig.parent_pid()
    if parent is None:
        return
    if envconfig.parent_death_signal():
        _set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:
        _exit_orphaned(parent)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        _exit_orphaned(parent)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _set_parent_death_signal(signum: int) -> bool:
    """prctl(PR_SET_PDEATHSIG, signum) through libc; False where there is no such call (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_orphaned(parent: int) -> None:
    print(f"runner: parent process {parent} is gone, exiting", file=sys.stderr, flush=True)
    os._exit(1)  # nothing to flush: the runner's state dies with it
