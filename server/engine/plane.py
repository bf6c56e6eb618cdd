"""The data plane: the registry of the models a server holds, and what every call shares, behind every door
(as KServe's DataPlane over its ModelRepository). A door asks it for a model by the name a request gives
(`model`); no door checks names itself. `build_plane` assembles it, the same for a server of one process, a
front end of a server with --workers (the engine process's queues) and the tests."""

import asyncio
from collections.abc import Callable

from attnserve.server.config import ServeConfig
from attnserve.server.engine.model import Scheduler, ServedModel, listed
from attnserve.server.engine.offload import Offload
from attnserve.server.engine.registry import NamedArtifact
from attnserve.server.engine.tokenize import TextTokenizer
from attnserve.server.errors import NotFound, quote
from attnserve.server.memory.budget import MemoryBudget, ModelMemory
from attnserve.server.memory.ledger import Holds, trim_after
from attnserve.server.metrics import Metrics
from attnserve.server.runtime.backend import Placement

# A request is held this many times over while its call lasts: the bytes received, the
# parsed message or JSON, and the Python objects made from it (texts as str, ids as arrays).
REQUEST_COPIES = 3
# A request this small is not counted: health checks and one-text calls are never refused
# for memory (1,000 streams of a gRPC connection hold at most 16 MiB of them).
UNCOUNTED_REQUEST_BYTES = 16 << 10


class DataPlane:
    def __init__(self, models: list[ServedModel], memory: MemoryBudget, offload: Offload,
                 metrics: Metrics, serving: Callable[[], bool]):
        """`models` in the order named, the first the default; `serving() -> bool`: every
        model warm and the server not draining."""
        self.models, self.default = {m.name: m for m in models}, models[0]
        self.memory, self.offload, self.metrics, self.serving = memory, offload, metrics, serving
        self.owed: set[Holds] = set()
        """the calls (by their holds) whose answer is owed: a request taken, its answer not yet sent"""
        self.none_owed = asyncio.Event()
        self.none_owed.set()

    def model(self, name: str | None, field: str = "model", kind: str | None = None) -> ServedModel:
        """The model a request names (`field`, as the door calls it; empty: the default, or the first model of
        `kind` where one is served). The call's metrics carry its name from here on."""
        model = (self.models.get(name) if name else
                 next((m for m in self.models.values() if m.kind == kind), self.default))
        if model is None:
            raise NotFound(f"{field}: unknown model {quote(name)}; this server serves {self.served()}", field)
        self.metrics.routed_to(model.name)
        return model

    def served(self) -> str:
        return listed(list(self.models))

    check_serving = ServedModel.check_serving  # every model's `serving` is the server's

    # --- a call's memory, the same for every door ------------------------------------

    def holds(self, connection: str | None = None) -> Holds:
        """A call's memory holds, released by `end_call` once the answer has been sent;
        `connection` (the caller's peer) is charged its share."""
        return self.memory.ledger.holds(connection)

    @staticmethod
    def hold_request(holds: Holds, received: int, held: int = 0) -> int:
        """Hold a request of `received` bytes so far (as received, parsed and converted:
        REQUEST_COPIES over), beside the `held` already taken for it; a small one is not
        counted. Returns what the request holds now."""
        if received <= UNCOUNTED_REQUEST_BYTES:
            return held
        holds.take(REQUEST_COPIES * received - held, "request")
        return REQUEST_COPIES * received

    def end_call(self, holds: Holds, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """The answer has been sent (or the caller is gone): everything the call held goes back, and a call
        that held much hands the heap's free pages back to the OS (on the responses pool, after a moment for
        the transport to free what it sent). `loop`: the server's event loop, for a caller outside it."""
        holds.release()
        self.answer_sent(holds)
        trim_after(holds, self.offload.responses_pool, loop or asyncio.get_running_loop())

    # --- answers owed, which a drain waits for before it closes the ports -------------
    # A finished batch is not a sent answer: packing a large one and writing it to a slow
    # reader can take longer than any fixed grace, and the ports' close would cut it off.

    def answer_owed(self, holds: Holds) -> None:
        """The call of `holds` has taken a request; its answer is owed until `answer_sent` (or `end_call`)."""
        self.owed.add(holds)
        self.none_owed.clear()

    def answer_sent(self, holds: Holds) -> None:
        self.owed.discard(holds)
        if not self.owed:
            self.none_owed.set()

    async def answers_sent(self, seconds: float) -> bool:
        """Wait at most `seconds` for every answer owed to be sent; True when it has been."""
        if self.none_owed.is_set():
            return True
        try:
            await asyncio.wait_for(self.none_owed.wait(), max(seconds, 0.0))
            return True
        except TimeoutError:
            return False


def build_plane(config: ServeConfig, named: list[NamedArtifact], tokenizers: list[TextTokenizer],
                runs: list[tuple[Scheduler, ModelMemory, Placement]], budget: MemoryBudget,
                offload: Offload, metrics: Metrics, serving: Callable[[], bool]) -> DataPlane:
    """The data plane of these models, each with its tokenizer and (scheduler, memory,
    placement), in --artifact's order."""
    models = [ServedModel(n.name, n.artifact, tokenizer, scheduler, memory, placement, offload,
                          metrics, serving, config.max_chunking_chars, n.default_prompt)
              for n, tokenizer, (scheduler, memory, placement)
              in zip(named, tokenizers, runs, strict=True)]
    return DataPlane(models, budget, offload, metrics, serving)
