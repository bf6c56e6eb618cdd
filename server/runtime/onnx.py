"""The onnxruntime backend (the only module of the server that imports onnxruntime, seen by
the batch loop through `backend.Backend`): which provider, which graphs, how many lanes of
sessions (each running one batch at a time on its own inference thread), shape buckets
(`shapes.py`), only the outputs a batch needs copied off the device, and CUDA graphs per
shape bucket over fixed input and output buffers (IO binding).
"""

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from attnserve.artifact import (
    DENSE_INPUT,
    DENSE_OUTPUT,
    HIDDEN_OUTPUT,
    LOGITS_OUTPUT,
    MULTI_VECTOR_OUTPUT,
    SCORERS,
    SPARSE_OUTPUT,
    TOKEN_TYPES,
    TOKEN_WEIGHTS_OUTPUT,
    Artifact,
    ArtifactError,
    Graph,
    Manifest,
    attention_output,
    cpu_session_config,
    pooled_output,
    required_outputs,
    sequence_outputs,
)
from attnserve.server.config import ConfigError
from attnserve.server.host import gpu_present, set_malloc_for_inference, trim_heap
from attnserve.server.runtime.backend import (
    DEFAULT_STRATEGY,
    HIDDEN_ONLY,
    BatchOutput,
    Outputs,
    Placement,
    Strategy,
)
from attnserve.server.runtime.shapes import Shape, ShapeBuckets

log = logging.getLogger("attnserve.backend")
# onnxruntime's usage telemetry: nothing of a server's is sent anywhere, and on a read-only
# root it would try to write a device id under $HOME at every start.
ort.disable_telemetry_events()

# What KServe's model metadata calls this backend.
PLATFORM = "onnxruntime_onnx"
CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# What onnxruntime raises for a file it cannot load as a graph: the artifact's fault.
GRAPH_ERRORS = (ort_errors.InvalidProtobuf, ort_errors.InvalidGraph, ort_errors.NoSuchFile,
                ort_errors.NoModel, ort_errors.NotImplemented, ort_errors.Fail)
# Progress lines while warming up: about this many per lane.
WARM_UP_LOG_LINES = 10


class DeviceError(RuntimeError):
    """--device cuda was asked for and CUDA cannot be used."""


def choose_provider(device: str) -> tuple[str, str]:
    """(provider, why). `cuda` never falls back: a GPU pod must not run on the CPU silently."""
    if device == "cpu":
        return CPU, "--device cpu"
    present, why = gpu_present()
    if not present:
        if device == "cuda":
            raise DeviceError(f"--device cuda: no usable GPU: {why}")
        return CPU, f"no GPU: {why}"
    if CUDA not in ort.get_available_providers():
        if device == "cuda":
            raise DeviceError("--device cuda: this onnxruntime build has no CUDA provider "
                              "(install onnxruntime-gpu)")
        return CPU, "onnxruntime has no CUDA provider"
    return CUDA, why


def preload_cuda_libraries() -> None:
    """CUDA and cuDNN from the nvidia-* wheels, where the system has none: onnxruntime-gpu
    finds them once they are loaded (older builds lack preload_dlls; the libraries may then
    be the system's)."""
    try:
        ort.preload_dlls()
    except Exception as err:  # noqa: BLE001 - the session's own error says more, if any
        log.info("event=preload_dlls_skipped reason=%r", str(err))


def place(manifest: Manifest, device: str, precision: str) -> Placement:
    """The provider `--device` picks and the graphs' precision (`auto`: fp16 on CUDA when
    the artifact has fp16 graphs, else fp32), both checked against the artifact."""
    provider, why = choose_provider(device)
    if precision == "auto":
        has_fp16 = manifest.graph(attention=False, precision="fp16") is not None
        precision = "fp16" if provider == CUDA and has_fp16 else "fp32"
    needed = (False,) if manifest.kind in SCORERS else (False, True)
    if any(manifest.graph(attention=a, precision=precision) is None for a in needed):
        raise ArtifactError(f"{manifest.model_name}: no {precision} graphs (export with --{precision})")
    if precision == "int8" and provider == CUDA:
        # Their quantized kernels (QAttention, DynamicQuantizeMatMul) are CPU ones.
        raise ConfigError("precision", "int8 graphs run on the CPU: add --device cpu")
    return Placement(provider, precision, "cuda" if provider == CUDA else "cpu", why, PLATFORM)


def session_options(threads: int, provider: str, precision: str = "fp32",
                    spinning: bool = True) -> ort.SessionOptions:
    """`spinning`: its intra-op threads may spin while they wait for work."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if provider == CPU:
        for key, value in cpu_session_config(precision).items():
            options.add_session_config_entry(key, value)
    # The CPU arena is off: the per-batch memory figure (see server/memory/probe.py) and
    # the memory model count onnxruntime's own allocations, which an arena hides after
    # its first growth, and what a long batch took goes back to the OS once idle. glibc
    # is set up to keep that fast instead (set_malloc_for_inference, called when a CPU
    # backend is built).
    options.enable_cpu_mem_arena = False
    # Memory patterns are planned per input shape and, with shapes that change from batch
    # to batch, made a small batch after a large one allocate a block sized for the large
    # one (measured: 60 MiB for 1×16 after 32×128): its peak would depend on what ran
    # before, past what the memory model can predict.
    options.enable_mem_pattern = False
    return options


def providers_for(provider: str, cuda_graph: bool = False) -> list:
    if provider == CUDA:
        # kSameAsRequested: grow the arena by what is asked, not by doubling, so the
        # device holds close to the real peak.
        options = {"arena_extend_strategy": "kSameAsRequested"}
        if cuda_graph:
            options["enable_cuda_graph"] = "1"
        return [(CUDA, options), CPU]
    return [CPU]


Results = dict[str, np.ndarray]


def graph_feed(inputs: list[str], input_ids: np.ndarray, attention_mask: np.ndarray,
               token_type_ids: np.ndarray | None) -> dict[str, np.ndarray]:
    """The graph's `inputs`; token types where it takes them: as given, or every token 0."""
    feed = {"input_ids": input_ids, "attention_mask": attention_mask}
    if TOKEN_TYPES in inputs:
        feed[TOKEN_TYPES] = np.zeros_like(input_ids) if token_type_ids is None else token_type_ids
    return feed


class PlainRunner:
    """`session.run` for the outputs asked for: onnxruntime copies only those off the
    device (a pooled vector is [batch, hidden]; the hidden state it came from stays)."""

    def __init__(self, session: ort.InferenceSession, cheapest: str):
        self.session, self.cheapest = session, cheapest
        self.inputs = [i.name for i in session.get_inputs()]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, names: list[str],
            token_type_ids: np.ndarray | None = None) -> Results:
        feed = graph_feed(self.inputs, input_ids, attention_mask, token_type_ids)
        return dict(zip(names, self.session.run(names, feed), strict=True))

    def warm(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> None:
        self.run(input_ids, attention_mask, [self.cheapest])


@dataclass
class _Slot:
    """One shape's fixed buffers, bound once."""

    inputs: dict[str, ort.OrtValue]
    outputs: dict[str, ort.OrtValue]
    binding: ort.IOBinding
    options: ort.RunOptions


class BoundRunner:
    """Fixed input and output buffers per shape, bound once (IO binding), and with CUDA
    graphs one graph per shape: a replay reads and writes the addresses it was captured
    with. onnxruntime captures the graph of an id (`gpu_graph_id`, from 1; 0 is its own,
    -1 means none) on that id's third run, after two ordinary ones, and replays it from
    then on. Every output is bound (a graph writes them all); only those asked for are
    copied out."""

    RUNS_TO_CAPTURE = 3

    def __init__(self, session: ort.InferenceSession, device: str, manifest: Manifest, cuda_graph: bool):
        self.session, self.device, self.manifest, self.cuda_graph = session, device, manifest, cuda_graph
        self.slots: dict[Shape, _Slot] = {}
        self.inputs = [i.name for i in session.get_inputs()]

    def _output_shapes(self, batch: int, seq: int) -> dict[str, tuple[int, ...]]:
        m = self.manifest
        if m.kind in SCORERS:
            return {LOGITS_OUTPUT: (batch, len(m.labels))}
        heads = {SPARSE_OUTPUT: (batch, m.vocab_size), TOKEN_WEIGHTS_OUTPUT: (batch, seq),
                 MULTI_VECTOR_OUTPUT: (batch, seq, m.multi_vector.dim if m.multi_vector else 0)}
        return {HIDDEN_OUTPUT: (batch, seq, m.hidden_size)} | {
            name: (batch, m.embedding_size) for name in m.pooled_outputs} | {
            name: heads[name] for name in m.head_outputs}

    def _new_slot(self, shape: Shape) -> _Slot:
        def buffer(dims: tuple[int, ...], dtype: type) -> ort.OrtValue:
            return ort.OrtValue.ortvalue_from_shape_and_type(dims, dtype, self.device, 0)

        binding = self.session.io_binding()
        inputs = {name: buffer(shape, np.int64) for name in self.inputs}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        outputs = {name: buffer(dims, np.float32) for name, dims in self._output_shapes(*shape).items()}
        for name, value in outputs.items():
            binding.bind_ortvalue_output(name, value)
        options = ort.RunOptions()
        if self.cuda_graph:
            options.add_run_config_entry("gpu_graph_id", str(len(self.slots) + 1))
        return _Slot(inputs, outputs, binding, options)

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, names: list[str],
            token_type_ids: np.ndarray | None = None) -> Results:
        shape = input_ids.shape
        slot = self.slots.get(shape)
        if slot is None:
            slot = self.slots[shape] = self._new_slot(shape)
        for name, value in graph_feed(self.inputs, input_ids, attention_mask, token_type_ids).items():
            slot.inputs[name].update_inplace(value)
        self.session.run_with_iobinding(slot.binding, slot.options)
        # From the device numpy() copies; on the CPU it is a view of the fixed buffer,
        # which the next batch of this shape overwrites.
        copy = self.device == "cpu"
        return {name: slot.outputs[name].numpy().copy() if copy else slot.outputs[name].numpy()
                for name in names}

    def warm(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> None:
        for _ in range(self.RUNS_TO_CAPTURE):
            self.run(input_ids, attention_mask, [])


@dataclass(eq=False)
class Lane:
    """One session per graph, running one batch at a time from its inference thread (a
    reranker's lane has no attention graph); the first lane's also run the beside
    thread's batch (Backend.beside) at the same time."""

    index: int
    embed: PlainRunner | BoundRunner
    attend: PlainRunner | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    seen: set[tuple[bool, Shape]] = field(default_factory=set)
    """(attention graph, shape) run on this lane"""


class OrtBackend:
    """`sessions` lanes of sessions (embeddings only, and with attention maps), one
    provider, shape buckets and CUDA graphs as the strategy says."""

    platform = PLATFORM

    def __init__(self, artifact: Artifact, device: str = "auto", precision: str = "auto",
                 intra_op_threads: int = 0, strategy: Strategy = DEFAULT_STRATEGY):
        self.artifact, self.strategy, manifest = artifact, strategy, artifact.manifest
        placement = place(manifest, device, precision)
        provider, why, self.precision = placement.provider, placement.why, placement.precision
        self.embed_graph = manifest.graph(attention=False, precision=self.precision)
        self.attn_graph = (None if manifest.kind in SCORERS
                           else manifest.graph(attention=True, precision=self.precision))
        self.sequence_outputs = sequence_outputs(manifest)
        # The output fetched when a batch's requests need none at all (only token ids back, or
        # a warm-up): the smallest there is (SPLADE has no pooled vector).
        self.cheapest = (LOGITS_OUTPUT if manifest.kind in SCORERS else
                         pooled_output("cls", False) if manifest.dense else HIDDEN_OUTPUT)
        try:
            self._build(provider, intra_op_threads)
        except Exception as err:
            if isinstance(err, DeviceError | ConfigError) or device != "auto" or provider != CUDA:
                raise
            log.warning("event=cuda_failed reason=%r fallback=cpu", str(err))
            provider, why = CPU, f"CUDA provider failed to load: {err}"
            self._build(provider, intra_op_threads)
        self.placement = Placement(self.provider, self.precision, self.device, why, PLATFORM)
        # The Dense layers are a few matmuls on [n, hidden] vectors: the CPU, one thread.
        self.dense = (None if not manifest.dense_graph else self._load(
            artifact.path(manifest.dense_graph), session_options(1, CPU), [CPU]))
        self._local, self._bound = threading.local(), itertools.count()
        log.info("event=provider model=%s provider=%s precision=%s threads=%d sessions=%d shape_buckets=%s "
                 "cuda_graphs=%s reason=%r graphs=%s,%s", manifest.model_name, provider, self.precision,
                 self.threads, self.concurrency, "off" if self.buckets is None else
                 f"rows_pow2_to_{self.buckets.max_batch_size},seq_multiple_{self.buckets.seq_multiple}",
                 self.cuda_graphs, why, self.embed_graph.file,
                 self.attn_graph.file if self.attn_graph else "-")

    def _build(self, provider: str, intra_op_threads: int) -> None:
        """Resolve the strategy for `provider` and open every lane's sessions."""
        s, manifest = self.strategy, self.artifact.manifest
        buckets = s.shape_buckets == "on" or (s.shape_buckets == "auto" and provider == CUDA)
        self.buckets = (ShapeBuckets(s.bucket_seq_multiple, s.max_batch_size, manifest.max_positions)
                        if buckets else None)
        if s.cuda_graphs and self.buckets is None:
            raise ConfigError("cuda_graphs", "needs shape buckets (one graph per bucket): "
                                             "add --shape-buckets on")
        self.cuda_graphs = s.cuda_graphs and provider == CUDA
        if s.cuda_graphs and provider != CUDA:
            log.info("event=cuda_graphs provider=%s note='no CUDA: fixed IO-bound buffers per "
                     "shape bucket, no graph capture'", provider)
        # On CUDA the intra-op pool only runs the few nodes left on the CPU; threads per
        # core there would spin against the server's own threads.
        self.threads = intra_op_threads or (1 if provider == CUDA else len(os.sched_getaffinity(0)))
        self.concurrency = s.sessions or (2 if provider == CUDA else 1)
        # One batch running per lane, and one more formed and waiting.
        self.max_in_flight = self.concurrency + 1
        # onnxruntime runs a session from several threads at once; IO-bound buffers (CUDA
        # graphs) are one batch's at a time.
        self.beside = not s.cuda_graphs
        self.provider, self.device = provider, "cuda" if provider == CUDA else "cpu"
        if provider == CPU:
            set_malloc_for_inference()
        else:
            preload_cuda_libraries()
        self.lanes = []
        for index in range(self.concurrency):
            embed_session = self._session(self.embed_graph, provider, s.cuda_graphs)
            embed = (BoundRunner(embed_session, self.device, manifest, self.cuda_graphs)
                     if s.cuda_graphs else PlainRunner(embed_session, self.cheapest))
            attend = (PlainRunner(self._session(self.attn_graph, provider, False), self.cheapest)
                      if self.attn_graph else None)
            self.lanes.append(Lane(index, embed, attend))

    @staticmethod
    def _load(path, options: ort.SessionOptions, providers: list) -> ort.InferenceSession:
        try:
            return ort.InferenceSession(str(path), options, providers=providers)
        except GRAPH_ERRORS as err:
            raise ArtifactError(f"{path}: onnxruntime cannot load this graph ({err})") from err

    def _session(self, graph: Graph, provider: str, cuda_graph: bool) -> ort.InferenceSession:
        path, manifest = self.artifact.path(graph.file), self.artifact.manifest
        session = self._load(path, session_options(self.threads, provider, graph.precision,
                                                   self.strategy.spinning),
                             providers_for(provider, cuda_graph))
        if provider == CUDA and CUDA not in session.get_providers():
            raise DeviceError(f"{graph.file}: onnxruntime did not place the graph on CUDA")
        inputs = [i.name for i in session.get_inputs()]
        if inputs != list(manifest.inputs):
            raise ArtifactError(f"{path}: graph inputs {inputs}, expected {list(manifest.inputs)}")
        for i in session.get_inputs():
            if i.type != "tensor(int64)" or len(i.shape) != 2:
                raise ArtifactError(f"{path}: graph input {i.name} is {i.type} {i.shape}, "
                                    "expected tensor(int64) [batch, seq]")
        outputs = {o.name for o in session.get_outputs()}
        missing = [name for name in required_outputs(manifest, graph) if name not in outputs]
        if missing:
            raise ArtifactError(f"{path}: graph lacks outputs {missing} (exported by an older "
                                "attnserve? export it again: attnserve export --unless-current "
                                "--out DIR, as make serve does)")
        return session

    def bind_thread(self, beside: bool = False) -> None:
        if beside:
            self._local.lane, self._local.beside = self.lanes[0], True
        else:  # next() of a count is atomic (a C call under the GIL): the lanes in turn
            self._local.lane = self.lanes[next(self._bound) % len(self.lanes)]

    def _lane(self) -> Lane:
        # A thread that is not an inference thread (a test, a tool) uses the first lane;
        # the lane's lock keeps it to one batch at a time.
        return getattr(self._local, "lane", self.lanes[0])

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            layers: tuple[int, ...] = (), outputs: Outputs = HIDDEN_ONLY,
            token_type_ids: np.ndarray | None = None) -> BatchOutput:
        """One padded batch. With `layers`, the attention graph runs and returns only
        those layers' maps, so onnxruntime frees the others as it goes."""
        names = [HIDDEN_OUTPUT] if HIDDEN_OUTPUT in outputs else []
        names += [name for name in self.sequence_outputs if name in outputs]
        names += [attention_output(layer) for layer in layers]
        lane = self._lane()
        with nullcontext() if getattr(self._local, "beside", False) else lane.lock:
            key = (bool(layers), input_ids.shape)
            new_shape = key not in lane.seen
            lane.seen.add(key)
            runner = lane.attend if layers else lane.embed
            got = runner.run(input_ids, attention_mask, names or [self.cheapest], token_type_ids)
        return BatchOutput(got.get(HIDDEN_OUTPUT), {layer: got[attention_output(layer)] for layer in layers},
                           {name: got[name] for name in self.sequence_outputs if name in outputs}, new_shape)

    def project(self, vectors: np.ndarray) -> np.ndarray:
        return vectors if self.dense is None else self.dense.run([DENSE_OUTPUT], {DENSE_INPUT: vectors})[0]

    def release_memory(self) -> None:
        """glibc malloc_trim. The CPU sessions run without an arena (see session_options and
        set_malloc_for_inference); CUDA sessions keep theirs (their IO-bound buffers and
        captured graphs point into them)."""
        trim_heap()

    def padded_shape(self, batch: int, longest: int) -> Shape:
        return (batch, longest) if self.buckets is None else self.buckets.padded(batch, longest)

    def warm_up_shapes(self, max_batch_tokens: int) -> list[Shape]:
        """Every bucket a batch may be padded to; without buckets a small shape and, on
        CUDA, the largest batch the loop may form, so the arena and kernels are ready
        before the first caller."""
        if self.buckets is not None:
            return self.buckets.reachable(max_batch_tokens)
        shapes = [(1, 8)]
        if self.provider == CUDA:
            seq = self.artifact.manifest.max_positions
            shapes.append((max(1, max_batch_tokens // seq), seq))
        return shapes

    def warm_up(self, shapes: Iterable[Shape]) -> None:
        """The embeddings graph at every shape (CUDA graphs captured), the attention
        graph at the first, on the calling thread's lane, logging progress."""
        shapes = list(shapes)
        lane, started = self._lane(), time.perf_counter()
        every = max(1, len(shapes) // WARM_UP_LOG_LINES)
        with lane.lock:
            for done, shape in enumerate(shapes, 1):
                ids = np.full(shape, self.artifact.manifest.pad_token_id, dtype=np.int64)
                mask = np.ones(shape, dtype=np.int64)
                lane.embed.warm(ids, mask)
                lane.seen.add((False, shape))
                if done == 1 and lane.attend is not None:
                    lane.attend.warm(ids, mask)
                    lane.seen.add((True, shape))
                if done % every == 0 or done == len(shapes):
                    log.info("event=warm_up lane=%d shapes=%d/%d last=%dx%d seconds=%.2f",
                             lane.index, done, len(shapes), *shape, time.perf_counter() - started)


# The "onnx" artifacts' backend.BackendKind: graphs run by onnxruntime.
KIND = SimpleNamespace(place=place, create=OrtBackend)
