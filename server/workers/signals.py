"""Which signals stop the processes of a group (--workers), and who sends them: SIGINT and
SIGTERM are the supervisor's alone, and it sends each child STOP in turn, so that the group
stops in order (docs/architecture.md, "Worker processes", says why)."""

import asyncio
import contextlib
import ctypes
import os
import signal
import sys

STOP = signal.SIGUSR1
GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def starting_a_child():
    """Around starting a child process (it inherits the signal mask): a STOP, SIGINT or
    SIGTERM that reaches the supervisor meanwhile is delivered to it once this ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {STOP, *GROUP_SIGNALS})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def become_child(supervisor_pid: int) -> None:
    """First thing in a child: ignore SIGINT and SIGTERM (one that came while it started is
    dropped), leave at once on STOP, and die with the supervisor, or now if it is gone."""
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(STOP, lambda signum, frame: sys.exit(0))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {STOP, *GROUP_SIGNALS})
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    # The supervisor may have died before the prctl: the child has a new parent then.
    if os.getppid() != supervisor_pid:
        os._exit(1)


def take_stop() -> asyncio.Event:
    """From now on a STOP sets the event returned, on the running loop: the child has work
    to finish."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(STOP, stop.set)
    return stop
