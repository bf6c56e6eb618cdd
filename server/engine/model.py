"""One served model, protocol-neutral, and the steps every call to it shares: readiness, the cheap bounds
before any work (entry counts, queue room, the response's size), tokenizing or reading ids, the memory budget
and the call's holds, the deadline, and what runs inline or on a pool (offload.py). Each of the model's jobs
is a module of its own (engine/__init__.py names them); a model asked for a job of another kind refuses it,
naming what it is. It hands sequences to its scheduler (the request queue and batch loop in this process, or
the engine process's with `--workers`) and gets back each sequence's share of a batch's outputs."""

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol, TypeVar

from attnserve.artifact import (
    CLASSIFIER,
    EMBEDDER,
    HIDDEN_OUTPUT,
    LOGITS_OUTPUT,
    RERANKER,
    SCORERS,
    Artifact,
    attention_output,
)
from attnserve.server.engine import timings
from attnserve.server.engine.offload import POOLED_S, SPAN_S, TEXT_CHAR_S, TEXT_S, Offload, cost
from attnserve.server.engine.pooling import POOLED, finish, prompt_spans
from attnserve.server.engine.requests import ModelInfo, Submission, TensorInfo, TruncationDirection
from attnserve.server.engine.tokenize import Encoded, Prompt, TextTokenizer, TooLong
from attnserve.server.errors import InvalidArgument, Unavailable, quote
from attnserve.server.memory.budget import RESPONSE_COPIES, ModelMemory
from attnserve.server.memory.ledger import Holds
from attnserve.server.metrics import Metrics
from attnserve.server.runtime.backend import Placement, SequenceResult

ALL_ATTENTIONS = "attentions"
"""the output holding every layer's attention maps, stacked: [layers, batch, heads, seq, seq]"""
T = TypeVar("T")
NOT_SERVING = "server is not serving (starting, or draining): send the request to another replica"
KINDS_SAID = {EMBEDDER: ("an embedding model", "it embeds texts and scores texts against a "
                                               "query from their vectors"),
              RERANKER: ("a reranker (a cross-encoder)", "it scores (query, text) pairs"),
              CLASSIFIER: ("a classifier", "it scores every label of a text or a pair of texts")}
"""kind -> (what it is, what it does), as a refusal says them"""
# A refusal names at most this many of a server's models or of a model's prompts.
LISTED = 16


def listed(names: list[str]) -> str:
    more = len(names) - LISTED
    return ", ".join(map(repr, names[:LISTED])) + (f" and {more} more" if more > 0 else "")


class Scheduler(Protocol):
    """Where sequences go to be run: the request queue (server/engine/queue.py), or the
    engine process's (server/workers/front_end.py)."""

    def admit(self, tokens: int, at_least: bool = False) -> None:
        """Refuse (ResourceExhausted, Unavailable) a request the queue has no room for."""

    async def submit(self, submission: Submission) -> list[SequenceResult]:
        ...


class ServedModel:
    def __init__(self, name: str, artifact: Artifact, tokenizer: TextTokenizer,
                 scheduler: Scheduler, memory: ModelMemory, placement: Placement,
                 offload: Offload, metrics: Metrics, serving: Callable[[], bool],
                 max_chunking_chars: int, default_prompt: str | None = None):
        """`name`: what callers name it by; `serving() -> bool`: warm and not draining;
        `max_chunking_chars`: the longest text a chunked request may carry;
        `default_prompt`: the name of the prompt a request that names none gets."""
        self.name, self.artifact, self.manifest = name, artifact, artifact.manifest
        self.tokenizer, self.scheduler, self.memory = tokenizer, scheduler, memory
        self.offload, self.metrics, self.placement = offload, metrics, placement
        self.serving, self.max_chunking_chars = serving, max_chunking_chars
        self.default_prompt, self.kind = default_prompt, artifact.manifest.kind
        m = self.manifest
        self.dimensions = sorted({m.embedding_size, *m.matryoshka_dims}, reverse=True)
        """the sizes a pooled vector may be cut to"""
        self.output_layers = {LOGITS_OUTPUT: ()} if m.kind in SCORERS else {
            HIDDEN_OUTPUT: (), ALL_ATTENTIONS: tuple(range(m.num_layers)),
            **{attention_output(i): (i,) for i in range(m.num_layers)}}
        """each tensor output the model answers raw tensor requests with -> the attention layers it needs"""

    def check_serving(self) -> None:
        """New work only while serving: UNAVAILABLE before warm-up ends and while draining."""
        if not self.serving():
            raise Unavailable(NOT_SERVING)

    def require(self, operation: str, *kinds: str) -> None:
        """Refuse an operation while not serving (check_serving), and one that a model of
        another kind does not serve, naming the model's kind."""
        self.check_serving()
        if self.kind not in kinds:
            what, does = KINDS_SAID[self.kind]
            takes = " or ".join(KINDS_SAID[kind][0] for kind in kinds)
            raise InvalidArgument("model", f"{self.name!r} is {what}: {does}; {operation} takes {takes}")

    def hold_response(self, holds: Holds, size: int, on_top: float = 0.0) -> None:
        """Hold a response of `size` bytes (several times over: see RESPONSE_COPIES) until
        it has been sent."""
        holds.take(RESPONSE_COPIES * size, "the response", on_top=on_top)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time a step of the running call both where operators and where its caller look:
        the stage_duration histogram, and the call's own record (timing headers, trace)."""
        with self.metrics.stage_duration.labels(self.name, name).time(), timings.stage(name):
            yield

    async def pack(self, seconds: float, build: Callable[..., T], *args) -> T:
        """`build(*args)`: a door's response built from a result, inline when it costs
        less than offload.INLINE_S, else on the responses pool."""
        with self.stage("respond"):
            return await self.offload.response(seconds, build, *args)

    def prompt(self, name: str | None, texts: bool = True) -> Prompt | None:
        """The prompt a request names (`prompt_name`), or the default one when it names
        none; `texts`: the request carries texts (token ids are run as sent)."""
        if not name:
            return self.tokenizer.prompts[self.default_prompt] if texts and self.default_prompt else None
        prompts = self.tokenizer.prompts
        if name not in prompts:
            raise InvalidArgument("prompt_name", f"{quote(name)} is not a prompt of "
                                  f"{self.name!r}; " + (f"its prompts: {listed(list(prompts))}"
                                                        if prompts else "it has none"))
        if not texts:
            raise InvalidArgument("prompt_name", "a prompt goes before texts: token ids are run as sent")
        return prompts[name]

    @staticmethod
    def left(direction: TruncationDirection, texts: bool = True) -> bool:
        """Whether a cut keeps a text's end; refused for token ids, cut as sent."""
        if direction is TruncationDirection.RIGHT:
            return False
        if not texts:
            raise InvalidArgument("truncation_direction", "left truncation keeps a text's "
                                  "special tokens: send texts, or cut token ids yourself")
        return True

    async def tokenize(self, texts: Sequence[str], truncate: bool, field_of: Callable[[int], str],
                       holds: Holds, details: bool = False, prompt: Prompt | None = None,
                       left: bool = False, special_tokens: bool = True) -> list[Encoded]:
        """The texts' token ids (TextTokenizer.encode), off the event loop when they are
        many or long; a text too long is refused naming its field, `field_of(index)`."""
        try:
            with self.stage("tokenize"):
                return await self.offload.request(
                    cost(texts, TEXT_S, TEXT_CHAR_S), self.tokenizer.encode, texts, truncate,
                    holds, details, prompt, left, special_tokens)
        except TooLong as err:
            raise InvalidArgument(field_of(err.index), err.reason) from err

    async def run(self, submission: Submission, field_of: Callable[[int], str],
                  response_bytes: int, holds: Holds, kept_bytes: int = 0) -> list[SequenceResult]:
        """Check the request against the memory budget, hold its response (and
        `kept_bytes` of results kept until it is built), and wait for its sequences'
        results; `field_of(i)`: the request's field sequence i comes from."""
        lengths = submission.lengths
        longest = int(lengths.argmax())
        submission.alone = alone = self.memory.check(
            int(lengths[longest]), field_of(longest), len(submission.layers), response_bytes)
        on_top = alone if self.memory.shared else 0.0
        self.hold_response(holds, response_bytes, on_top=on_top)
        if kept_bytes:
            holds.take(kept_bytes, "the token vectors kept until scored", on_top=on_top)
        if (times := timings.current()) is not None:
            times.compute_tokens += int(lengths.sum())
        return await self.scheduler.submit(submission)

    async def run_pooled(self, submission: Submission, field_of: Callable[[int], str],
                         response_bytes: int, holds: Holds, prompt: Prompt | None,
                         dimensions: int) -> list[SequenceResult]:
        """`run`, the pooled vectors among the outputs as the request asks for them:
        without the prompt's tokens where the model's pooling leaves them out (a span a
        sequence, in place of the graph's pooled output), cut to `dimensions` (0: whole)."""
        pooled = [name for name in submission.outputs if name in POOLED]
        pooling = None
        # The last token lies past the prompt: the graph's vector leaves the prompt out.
        if (prompt is not None and not self.manifest.include_prompt and pooled
                and POOLED[pooled[0]][0] != "lasttoken"):
            pooling = POOLED[pooled[0]][0]
            submission.outputs -= set(pooled)
            submission.spans = await self.offload.request(
                len(submission.lengths) * SPAN_S, prompt_spans, submission.lengths,
                prompt.length, pooling)
        results = await self.run(submission, field_of, response_bytes, holds)
        if pooling is not None or dimensions:
            await self.offload.request(len(results) * POOLED_S, finish, results, pooled,
                                       pooling is not None, dimensions)
        return results

    def output_shape(self, name: str, layers: tuple[int, ...], batch: int, seq: int) -> tuple[int, ...]:
        """Tensor output `name`'s shape (-1: an axis of any size) with `layers` asked for."""
        m = self.manifest
        if name == LOGITS_OUTPUT:
            return batch, len(m.labels)
        if name == HIDDEN_OUTPUT:
            return batch, seq, m.hidden_size
        if name == ALL_ATTENTIONS:
            return len(layers), batch, m.num_heads, seq, seq
        return batch, m.num_heads, seq, seq

    def model_info(self) -> ModelInfo:
        m = self.manifest
        outputs = [TensorInfo(name, "FP32", self.output_shape(name, layers, -1, -1))
                   for name, layers in self.output_layers.items()]
        return ModelInfo(
            model=self.name, hidden_size=m.hidden_size, num_layers=m.num_layers,
            num_heads=m.num_heads, max_positions=m.max_positions, vocab_size=m.vocab_size,
            default_pooling=m.default_pooling, provider=self.placement.provider,
            precision=self.placement.precision, platform=self.placement.platform,
            family=m.model_type, kind=m.kind, labels=list(m.labels),
            artifact_sha256=self.artifact.manifest_sha256,
            inputs=[TensorInfo(name, "INT64", (-1, -1)) for name in m.inputs],
            outputs=outputs, prompts=dict(m.prompts), default_prompt_name=self.default_prompt,
            matryoshka_dims=list(m.matryoshka_dims), embedding_size=m.embedding_size,
            heads=m.heads)
