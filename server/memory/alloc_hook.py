"""The allocation hook (alloc_peak.c, built by `make` into _alloc_peak.so): preloading it
into the server, and reading a batch's exact peak through it.

`attnserve serve` on the CPU starts itself again with the library in LD_PRELOAD (a
library that replaces malloc must be there before the process starts), and with glibc's
malloc tunables (server/host.py TUNABLES), read only at a start too. Without a C
compiler, or where the preload fails, the server runs on glibc's sampled count instead
(server/memory/probe.py) and says so in its log."""

import ctypes
import logging
import os
import sys
from pathlib import Path

from attnserve.server.host import with_malloc_tunables

log = logging.getLogger("attnserve.memory")

LIBRARY = Path(__file__).with_name("_alloc_peak.so")
# Set before starting again, so a preload that the loader ignored (it only warns) does not
# start the server over and over.
_TRIED = "ATTNSERVE_ALLOC_HOOK_TRIED"


def _functions():
    process = ctypes.CDLL(None)  # the preloaded library's symbols are global
    try:
        reset, peak = process.attnserve_alloc_reset, process.attnserve_alloc_peak
    except AttributeError:
        return None
    reset.restype, peak.restype = None, ctypes.c_longlong
    return reset, peak


_HOOK = _functions()


def loaded() -> bool:
    return _HOOK is not None


def start_with_hook() -> None:
    """Replace this process by itself with the hook preloaded, when it is built, not loaded
    yet, and not tried already; otherwise (or when that fails) return, and the server
    samples instead.

    Not beside another preloaded library: an allocator preloaded by the operator (jemalloc,
    tcmalloc) would serve the memory while the hook measured it with glibc's sizes."""
    if loaded() or not LIBRARY.is_file():
        return
    refused = ("the loader did not preload it" if os.environ.get(_TRIED) else
               "LD_PRELOAD already set" if os.environ.get("LD_PRELOAD") else None)
    if refused:
        log.warning("event=alloc_hook_not_loaded library=%s reason=%r", LIBRARY, refused)
        return
    env = dict(with_malloc_tunables(os.environ), **{_TRIED: "1", "LD_PRELOAD": str(LIBRARY)})
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as err:
        log.warning("event=alloc_hook_not_loaded library=%s reason=%r", LIBRARY, str(err))


def reset() -> None:
    """Start measuring the calling thread's allocations."""
    _HOOK[0]()


def peak() -> int:
    """The calling thread's most bytes allocated and not freed since `reset`, over what it
    held then."""
    return max(0, int(_HOOK[1]()))
