"""onnxruntime sessions: which provider, which graphs, and one batch through them."""

import logging
import os
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

from attnserve.artifact import HIDDEN_OUTPUT, INPUT_NAMES, Artifact, ArtifactError, attention_output
from attnserve.server.memory import gpu_present

log = logging.getLogger("attnserve.runtime")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# What onnxruntime raises for a file it cannot load as a graph: the artifact's fault.
GRAPH_ERRORS = (ort_errors.InvalidProtobuf, ort_errors.InvalidGraph, ort_errors.NoSuchFile,
                ort_errors.NoModel, ort_errors.NotImplemented, ort_errors.Fail)


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


def session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Without the CPU arena, memory a long batch took goes back once it is done,
    # instead of being held at its peak for the life of the process.
    options.enable_cpu_mem_arena = False
    return options


def providers_for(provider: str) -> list:
    if provider == CUDA:
        # kSameAsRequested: grow the arena by what is asked, not by doubling, so the
        # device holds close to the real peak.
        return [(CUDA, {"arena_extend_strategy": "kSameAsRequested"}), CPU]
    return [CPU]


@dataclass
class BatchOutput:
    hidden: np.ndarray
    """(batch, seq, hidden) float32"""
    attentions: dict[int, np.ndarray]
    """layer -> (batch, heads, seq, seq) float32, only the layers asked for"""


class Runtime:
    def __init__(self, artifact: Artifact, device: str = "auto", precision: str = "auto",
                 intra_op_threads: int = 0):
        self.artifact = artifact
        provider, why = choose_provider(device)
        manifest = artifact.manifest
        if precision == "auto":
            has_fp16 = manifest.graph(attention=False, precision="fp16") is not None
            precision = "fp16" if provider == CUDA and has_fp16 else "fp32"
        self.precision = precision
        threads = intra_op_threads or len(os.sched_getaffinity(0))
        self.embed_graph = manifest.graph(attention=False, precision=precision)
        self.attn_graph = manifest.graph(attention=True, precision=precision)
        if self.embed_graph is None or self.attn_graph is None:
            raise ArtifactError(f"{artifact.directory}: no {precision} graphs (export with --fp16)")
        try:
            self.embed = self._session(self.embed_graph.file, provider, threads)
            self.attend = self._session(self.attn_graph.file, provider, threads)
        except DeviceError:
            raise
        except Exception as err:
            if device == "auto" and provider == CUDA:
                log.warning("event=cuda_failed reason=%r fallback=cpu", str(err))
                provider, why = CPU, f"CUDA provider failed to load: {err}"
                self.embed = self._session(self.embed_graph.file, provider, threads)
                self.attend = self._session(self.attn_graph.file, provider, threads)
            else:
                raise
        self.provider = provider
        log.info("event=provider provider=%s precision=%s threads=%d reason=%r graphs=%s,%s",
                 provider, precision, threads, why, self.embed_graph.file, self.attn_graph.file)

    def _session(self, file: str, provider: str, threads: int) -> ort.InferenceSession:
        path = self.artifact.path(file)
        try:
            session = ort.InferenceSession(str(path), session_options(threads),
                                           providers=providers_for(provider))
        except GRAPH_ERRORS as err:
            raise ArtifactError(f"{path}: onnxruntime cannot load this graph ({err})") from err
        if provider == CUDA and CUDA not in session.get_providers():
            raise DeviceError(f"{file}: onnxruntime did not place the graph on CUDA")
        inputs = [i.name for i in session.get_inputs()]
        if inputs != list(INPUT_NAMES):
            raise ArtifactError(f"{path}: graph inputs {inputs}, expected {list(INPUT_NAMES)}")
        for i in session.get_inputs():
            if i.type != "tensor(int64)" or len(i.shape) != 2:
                raise ArtifactError(f"{path}: graph input {i.name} is {i.type} {i.shape}, "
                                    "expected tensor(int64) [batch, seq]")
        outputs = {o.name for o in session.get_outputs()}
        if HIDDEN_OUTPUT not in outputs:
            raise ArtifactError(f"{path}: graph has no {HIDDEN_OUTPUT} output")
        if file == self.attn_graph.file:
            missing = [attention_output(k) for k in range(self.artifact.manifest.num_layers)
                       if attention_output(k) not in outputs]
            if missing:
                raise ArtifactError(f"{path}: attention graph lacks outputs {missing}")
        return session

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray,
            layers: tuple[int, ...] = ()) -> BatchOutput:
        """One padded batch. With `layers`, the attention graph runs and returns only
        those layers' maps, so onnxruntime frees the others as it goes."""
        feed = {"input_ids": input_ids, "attention_mask": attention_mask}
        if not layers:
            (hidden,) = self.embed.run([HIDDEN_OUTPUT], feed)
            return BatchOutput(hidden, {})
        names = [HIDDEN_OUTPUT] + [attention_output(layer) for layer in layers]
        hidden, *maps = self.attend.run(names, feed)
        return BatchOutput(hidden, dict(zip(layers, maps, strict=True)))

    def warm_up(self, max_tokens: int) -> None:
        """Run both graphs once; on CUDA also the largest batch the scheduler may form, so
        the arena and kernels are ready before the first caller."""
        shapes = [(1, 8)]
        if self.provider == CUDA:
            seq = self.artifact.manifest.max_positions
            shapes.append((max(1, max_tokens // seq), seq))
        for batch, seq in shapes:
            ids = np.full((batch, seq), self.artifact.manifest.pad_token_id, dtype=np.int64)
            mask = np.ones((batch, seq), dtype=np.int64)
            self.run(ids, mask)
            self.run(ids, mask, (0,))
