"""Memory a call holds outside the batches, against the memory budget, until its answer
has been sent: a big request as received and parsed, texts being tokenized and the ids
they become, and the response from admission until the door has written it to the
caller.

Every byte is taken from one ledger before it is allocated, and a call that cannot have
it is refused at once (RESOURCE_EXHAUSTED), so a caller that stops reading cannot make
the server hold answer after answer. One connection may hold only a share of the
ledger, so a stalled reader stops itself, not the others.
"""

import asyncio
import contextlib
import math
import threading
from concurrent.futures import Executor
from dataclasses import dataclass

from attnserve.server.errors import ResourceExhausted
from attnserve.server.host import TRIM_AFTER_BYTES, trim_heap

MIB = 1 << 20
# One connection may hold this share of the ledger (any one call of it may hold more,
# when nothing else of the connection is held), so a caller that stops reading (zero
# HTTP/2 window) leaves the rest to the others.
PER_CONNECTION_SHARE = 0.25
# trim_after's moment for the transport to free what it sent.
TRIM_DELAY_S = 0.05


@dataclass(eq=False)
class Totals:
    """The ledger's totals, for one process: what is held, under what limit, and what is
    kept free for batches. With --workers, a server's processes share theirs instead
    (server/workers/shared.py: SharedTotals), so the budget covers the group."""

    limit: float
    held: int = 0
    reserve: float = 0.0
    """kept free beside what is held: the peak of the largest batch an admitted request
    still has to run alone (set by the request queue where the batches and the ledger
    share one budget)"""
    batches: float = 0.0
    """kept free too: what the batches in flight hold (set by the batch loop, ditto)"""

    def add(self, nbytes: int) -> None:
        self.held += nbytes

    def exclusive(self) -> contextlib.AbstractContextManager:
        """Held while a take is checked and made: the ledger's own lock suffices here."""
        return contextlib.nullcontext()


class Ledger:
    """Bytes held outside the batches, in total and per connection, under `limit`.
    Thread-safe: tokenizing takes and gives back memory from its own thread."""

    def __init__(self, limit: float | Totals):
        self.totals = limit if isinstance(limit, Totals) else Totals(limit)
        self.lock = threading.Lock()
        self.by_connection: dict[str, int] = {}

    limit = property(lambda self: self.totals.limit)
    held = property(lambda self: self.totals.held)

    def holds(self, connection: str | None = None) -> "Holds":
        """A call's holds; `connection` (its peer) is charged its share, None for none."""
        return Holds(self, connection)

    def _take(self, nbytes: int, connection: str | None, what: str, on_top: float, own: int) -> None:
        """Refuse, or add `nbytes` with `on_top` more still free after it; `own`: what
        the calling call holds already (its connection's other calls hold the rest)."""
        with self.totals.exclusive():
            totals, limit = self.totals, self.totals.limit
            if nbytes + on_top > limit:
                raise ResourceExhausted(
                    f"{what}: needs about {nbytes / MIB:.1f} MiB"
                    f"{f' beside {on_top / MIB:.0f} MiB for its batch' if on_top else ''}, more "
                    f"than the whole memory budget of {limit / MIB:.0f} MiB")
            mine = self.by_connection.get(connection, 0) if connection else 0
            share = limit * PER_CONNECTION_SHARE
            if mine > own and mine + nbytes > share:
                raise ResourceExhausted(
                    f"{what}: this connection's other calls already hold {(mine - own) / MIB:.1f} MiB of "
                    f"requests and answers not yet sent, and one connection may hold {share / MIB:.0f} MiB: "
                    "read the answers already sent, or spread calls over more connections")
            # Batches run in what the ledger leaves: it keeps free what those in flight hold,
            # and at least what the largest still waiting (or this call's own) needs alone.
            kept = max(totals.reserve, totals.batches, on_top)
            held = totals.held
            if nbytes > limit - held - kept:
                raise ResourceExhausted(
                    f"{what}: needs about {nbytes / MIB:.1f} MiB, but of the memory budget of "
                    f"{limit / MIB:.0f} MiB, {held / MIB:.0f} MiB is held by requests being parsed or "
                    f"tokenized and answers not yet sent and {kept / MIB:.0f} MiB is kept for batches; "
                    "retry with backoff")
            totals.add(nbytes)
            if connection:
                self.by_connection[connection] = mine + nbytes

    def _give_back(self, nbytes: int, connection: str | None) -> None:
        self.totals.add(-nbytes)
        if connection:
            self.by_connection[connection] -= nbytes
            if not self.by_connection[connection]:
                del self.by_connection[connection]


class Holds:
    """What one call holds; `release()` gives back all of it, and once released the
    call can take nothing more (work it left on a thread stops at its next `take`)."""

    def __init__(self, ledger: Ledger, connection: str | None):
        self.ledger, self.connection = ledger, connection
        self.total = self.peak = 0
        self.released = False

    def take(self, nbytes: float, what: str, on_top: float = 0.0) -> None:
        """Hold `nbytes` more, or raise ResourceExhausted naming `what`; `on_top`: bytes
        that must still be free beside it (the call's own batch)."""
        amount = math.ceil(nbytes)
        with self.ledger.lock:
            if self.released:
                raise ResourceExhausted(f"{what}: the call has ended")
            self.ledger._take(amount, self.connection, what, on_top, self.total)
            self.total += amount
            self.peak = max(self.peak, self.total)

    def give_back(self, nbytes: float) -> None:
        with self.ledger.lock:
            amount = min(math.ceil(nbytes), self.total)
            if amount > 0:
                self.ledger._give_back(amount, self.connection)
                self.total -= amount

    def release(self) -> None:
        with self.ledger.lock:
            if self.total:
                self.ledger._give_back(self.total, self.connection)
            self.total = 0
            self.released = True


def trim_after(holds: Holds, pool: Executor, loop: asyncio.AbstractEventLoop) -> None:
    """Once a call that held much is over (its memory given back, but kept by the heap),
    hand the heap's free pages back to the OS, after a moment for the sender to free
    what it sent. Safe from any thread."""
    if holds.peak >= TRIM_AFTER_BYTES:
        loop.call_soon_threadsafe(loop.call_later, TRIM_DELAY_S, pool.submit, trim_heap)
