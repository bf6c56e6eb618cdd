"""The memory budget: the predicted peak of a batch (the memory model) and what calls hold
outside the batches (the ledger), against one budget: what admission refuses and what the
batch loop lets run together."""

from collections.abc import Callable

from attnserve.server.errors import ResourceExhausted
from attnserve.server.memory.ledger import MIB, Ledger, Totals
from attnserve.server.memory.model import MemoryModel, MemoryModels

# A response is held several times over at its peak: the results, the message,
# protobuf's growing encode buffer and the bytes handed to gRPC. Measured on MiniLM (a 37
# MiB response of attention maps), the process rose 4-5 responses over the batch's own
# peak; a response is held this many times over from admission until it has been sent.
RESPONSE_COPIES = 4


class MemoryBudget:
    """One budget for every model the server holds: what their batches in flight may take
    together, and what calls hold outside the batches (the ledger: requests being parsed
    or tokenized, responses until sent).

    On the CPU both share the one budget: a model's batch loop runs what fits in the budget
    less what the ledger holds and every model's batches in flight hold, and the ledger
    keeps free the peak of the largest batch an admitted request of any model still has to
    run alone, so nothing admitted waits on a caller that does not read. On CUDA the budget
    is the device's, and the ledger, host memory, has a limit of its own (in `totals`)."""

    def __init__(self, budget_bytes: int, responses_in_budget: bool, totals: Totals | None = None):
        """`totals`: the ledger's totals with their limit set (shared by a server's processes
        with --workers); None: a ledger of its own whose limit is the budget."""
        self.budget, self.shared = budget_bytes, responses_in_budget
        self.ledger = Ledger(totals if totals is not None else budget_bytes)
        # By model (ModelMemory sets them): the peak its waiting requests need alone, what
        # its batches in flight hold, what wakes its batch loop.
        self.reserved: dict[str, float] = {}
        self.in_flight: dict[str, float] = {}
        self.waiting: dict[str, Callable[[], None]] = {}

    def room(self) -> float:
        """What the batches in flight, of every model, may take together now."""
        return self.budget - (self.ledger.held if self.shared else 0)

    def in_flight_bytes(self, besides: str | None = None) -> float:
        """What every model's batches in flight hold (but those of `besides`)."""
        return sum(held for model, held in self.in_flight.items() if model != besides)

    def for_model(self, name: str, model: MemoryModel | MemoryModels, heads: int,
                  hidden: int) -> "ModelMemory":
        return ModelMemory(self, name, model, heads, hidden)


class ModelMemory:
    """One model's predicted peaks (its memory model), against the budget every model
    shares: what admission refuses and what its batch loop lets run."""

    def __init__(self, budget: MemoryBudget, name: str, model: MemoryModel | MemoryModels,
                 heads: int, hidden: int):
        self.shared_budget, self.name, self.model = budget, name, model
        self.heads, self.hidden = heads, hidden

    budget = property(lambda self: self.shared_budget.budget)
    ledger = property(lambda self: self.shared_budget.ledger)
    shared = property(lambda self: self.shared_budget.shared)
    """the ledger and the batches share one budget (the CPU)"""

    def batch_bytes(self, batch: int, seq: int, layers: int) -> float:
        return self.model.predict(batch, seq, self.heads, layers)

    def room(self) -> float:
        return self.shared_budget.room()

    def others_in_flight(self) -> float:
        return self.shared_budget.in_flight_bytes(besides=self.name)

    def keep_free(self, peak: float) -> None:
        """The largest peak a waiting request needs to run alone: the ledger leaves the
        largest of every model's."""
        common = self.shared_budget
        common.reserved[self.name] = peak
        if self.shared:
            self.ledger.totals.reserve = max(common.reserved.values())

    def in_flight(self, held: float) -> None:
        """What the batches in flight hold now: the ledger leaves every model's. Less than
        before, the other models' batch loops are woken (`on_freed`)."""
        common = self.shared_budget
        freed = held < common.in_flight.get(self.name, 0.0)
        common.in_flight[self.name] = held
        if self.shared:
            self.ledger.totals.batches = common.in_flight_bytes()
        if freed:
            for other, wake in common.waiting.items():
                if other != self.name:
                    wake()

    def on_freed(self, wake: Callable[[], None]) -> None:
        """Call `wake()` (on the event loop the batch loops run on) whenever another
        model's batches in flight hold less."""
        self.shared_budget.waiting[self.name] = wake

    def check(self, longest: int, field: str, layers: int, response_bytes: int) -> float:
        """Refuse a request that could not run even alone; returns its peak, which its longest
        sequence (`field`, as the caller names it) decides."""
        peak = self.batch_bytes(1, longest, layers)
        if peak > self.budget:
            raise ResourceExhausted(self._too_big(field, longest, layers, peak))
        extra = RESPONSE_COPIES * response_bytes
        beside = peak if self.shared else 0.0
        if extra and beside + extra > self.ledger.limit:
            raise ResourceExhausted(
                f"the response, about {response_bytes / MIB:.1f} MiB, takes about {extra / MIB:.0f} MiB "
                f"to build and send on top of the batch's {beside / MIB:.0f} MiB at peak, over the memory "
                f"budget of {self.ledger.limit / MIB:.0f} MiB; what fits: a response of up to "
                f"{max(0.0, self.ledger.limit - beside) / RESPONSE_COPIES / MIB:.1f} MiB (send fewer "
                "texts per request, ask for fewer attention layers or heads, set average_heads, or use "
                "dtype=DTYPE_FLOAT16)")
        return peak

    def _alone_bytes(self, seq: int, layers: int) -> float:
        """One sequence alone with its response at the largest (every head, float32 maps,
        token embeddings): what the alternatives a refusal offers must fit in."""
        response = 4 * (layers * self.heads * seq * seq + (seq + 1) * self.hidden)
        return self.batch_bytes(1, seq, layers) + (RESPONSE_COPIES * response if self.shared else 0)

    def _too_big(self, field: str, length: int, layers: int, need: float) -> str:
        fits_len = max((n for n in range(1, length) if self._alone_bytes(n, layers) <= self.budget),
                       default=0)
        fits_layers = max((k for k in range(layers) if self._alone_bytes(length, k) <= self.budget),
                          default=0)
        return (f"{field}: {length} tokens with {layers} attention layer(s) returned needs about "
                f"{need / MIB:.0f} MiB at peak, over the memory budget of {self.budget / MIB:.0f} MiB; "
                f"what fits: up to {fits_len} tokens with {layers} layer(s), or {fits_layers} layer(s) at "
                f"{length} tokens")
