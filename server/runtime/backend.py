"""The seam between the batch loop and whatever runs the model: the batch loop hands a
padded batch to `Backend.run` and gets back the outputs its requests need; the framework,
provider, graphs, sessions and shape strategy behind it (onnxruntime today: onnx.py) are
the backend's own business.

A backend module offers a `KIND` (a BackendKind) for the artifact format it runs
(`Manifest.runtime`), named in BUILTIN and imported only when an artifact of its format
is served: adding a backend is one module and one line in BUILTIN (or one `register`
call from outside the server). `place` says where one would run, cheaply, nothing loaded.
"""

import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, Artifact, ArtifactError, Manifest
from attnserve.server.runtime.shapes import Shape as Shape

Outputs = frozenset[str]
"""Graph outputs a batch must bring back: HIDDEN_OUTPUT and the pooled vectors
(artifact.POOLED_OUTPUTS), or a reranker's LOGITS_OUTPUT; attention maps are asked for by
layer."""
HIDDEN_ONLY: Outputs = frozenset({HIDDEN_OUTPUT})


@dataclass(frozen=True)
class Strategy:
    """How batches run, as `attnserve serve` flags ask (each backend resolves the `auto`s
    for the device it runs on, and ignores what it has no use for)."""

    shape_buckets: str = "auto"
    bucket_seq_multiple: int = 32
    max_batch_size: int = 64
    sessions: int = 0
    cuda_graphs: bool = False
    spinning: bool = True
    """the backend's threads may spin between operations (the fastest for a process that
    has the cores to itself: onnxruntime's 1×16 takes 1.3× as long without), or must sleep,
    leaving the cores to the other processes of a group (--workers on the CPU)"""


DEFAULT_STRATEGY = Strategy()


@dataclass(frozen=True)
class Placement:
    """Where an artifact's graphs would run."""

    provider: str
    """the backend's name for it, e.g. CPUExecutionProvider (keys the memory model)"""
    precision: str
    """fp32, fp16 or int8"""
    device: str
    """cpu or cuda"""
    why: str
    """one phrase: why this provider, for the start-up log"""
    platform: str
    """the framework and format, as KServe's model metadata names it (onnxruntime_onnx)"""


@dataclass
class BatchOutput:
    hidden: np.ndarray | None
    """(batch, seq, hidden) float32, when asked for"""
    attentions: dict[int, np.ndarray]
    """layer -> (batch, heads, seq, seq) float32, only the layers asked for"""
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
    """the outputs of one vector per sequence (artifact.sequence_outputs), only those asked
    for: pooled output name -> (batch, hidden) float32, or a reranker's logits ->
    (batch, labels)"""
    new_shape: bool = False
    """the first run of this graph at this shape on the session that ran it"""


@dataclass
class SequenceResult:
    """One sequence's share of a batch's output, handed to the response builder."""

    hidden: np.ndarray | None
    """(num_tokens, hidden): a view of the batch output, padding trimmed; None unless
    the request needs token embeddings"""
    attentions: dict[int, np.ndarray]
    """layer -> (heads, num_tokens, num_tokens)"""
    pooled: dict[str, np.ndarray] = field(default_factory=dict)
    """output name -> this sequence's vector of it (pooled (hidden,), logits (labels,)):
    those the request asked for"""
    span_means: np.ndarray | None = None
    """(spans, hidden): the mean token embedding over each token span the request named
    for this sequence (RequestQueue.submit's `spans`)"""


class Backend(Protocol):
    provider: str
    device: str
    platform: str
    precision: str
    placement: Placement
    """the four above (as Placement says them) and why, as the backend resolved them"""
    concurrency: int
    """batches it runs at once, each on its own inference thread"""
    max_in_flight: int
    """batches worth having handed over at once: `concurrency` running and the rest
    formed, padded and waiting, so the device never waits for the next batch to be formed"""
    beside: bool
    """whether one more thread may run batches beside the `concurrency` others, on the
    first one's sessions (`bind_thread(beside=True)`): the batch loop runs the highest
    class's batches there while a lower class's batch runs"""

    def release_memory(self) -> None:
        """Hand back to the OS what earlier batches left allocated (arenas, heap); called
        on an inference thread when the server goes idle after a large batch."""

    def padded_shape(self, batch: int, longest: int) -> Shape:
        """The (batch, seq) shape a batch of `batch` sequences, the longest `longest`
        tokens, is run at: at least as large in both axes. Extra rows are all padding."""

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            layers: tuple[int, ...] = (), outputs: Outputs = HIDDEN_ONLY,
            token_type_ids: np.ndarray | None = None) -> BatchOutput:
        """One padded batch, int64 [batch, seq] each: the `outputs` named, and the
        attention maps of `layers` only. `token_type_ids`: each token's segment (a
        reranker's pairs: 0 for the query's side, 1 for the text's), for a graph that
        takes them (artifact.TOKEN_TYPES in the manifest's inputs); None: every token 0.
        Safe from up to `concurrency` threads at once."""

    def project(self, vectors: np.ndarray) -> np.ndarray:
        """float32 [n, hidden_size] vectors pooled outside the graph (a span's mean)
        through the checkpoint's Dense layers, as the graph's pooled outputs went:
        [n, embedding_size]; the vectors as they are where it has none. Safe from any
        thread."""

    def bind_thread(self, beside: bool = False) -> None:
        """Called once by each inference thread as it starts: the thread keeps the same
        sessions for its life (CUDA graphs belong to the thread that captured them).
        `beside`: the thread that runs batches beside the others (`beside`)."""

    def warm_up_shapes(self, max_batch_tokens: int) -> list[Shape]:
        """The shapes worth running before the first caller, for batches of up to
        `max_batch_tokens` padded tokens: every shape bucket when buckets are on."""

    def warm_up(self, shapes: Iterable[Shape]) -> None:
        """Run the graphs at each shape on the calling inference thread's sessions."""


class BackendKind(Protocol):
    def place(self, manifest: Manifest, device: str, precision: str) -> Placement:
        """Where `serve --device DEVICE --precision PRECISION` would run the artifact; raises
        ConfigError or a DeviceError for a choice that cannot be served."""

    def create(self, artifact: Artifact, device: str, precision: str, intra_op_threads: int,
               strategy: Strategy) -> Backend:
        ...


BUILTIN = {"onnx": "attnserve.server.runtime.onnx"}
"""runtime -> the module whose KIND runs it"""
KINDS: dict[str, BackendKind] = {}


def register(runtime: str, kind: BackendKind) -> None:
    KINDS[runtime] = kind


def kind_of(artifact: Artifact) -> BackendKind:
    runtime = artifact.manifest.runtime
    if runtime not in KINDS and runtime in BUILTIN:
        register(runtime, importlib.import_module(BUILTIN[runtime]).KIND)
    if runtime not in KINDS:
        raise ArtifactError(f"{artifact.path('manifest.json')}: runtime {runtime!r} is not one this "
                            f"server runs ({', '.join(sorted(KINDS.keys() | BUILTIN.keys()))})")
    return KINDS[runtime]


def place(artifact: Artifact, device: str = "auto", precision: str = "auto") -> Placement:
    return kind_of(artifact).place(artifact.manifest, device, precision)


def create_backend(artifact: Artifact, device: str = "auto", precision: str = "auto",
                   intra_op_threads: int = 0, strategy: Strategy = DEFAULT_STRATEGY) -> Backend:
    return kind_of(artifact).create(artifact, device, precision, intra_op_threads, strategy)
