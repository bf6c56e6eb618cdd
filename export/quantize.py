"""int8 graphs for the CPU: onnxruntime's dynamic quantization of an already-optimised fp32
graph, prepared so that it keeps the embeddings, and the parity gate they must pass.

Dynamic quantization gives each activation tensor ONE scale (per tensor, uint8), while the
weights get one per output channel (int8). On this model that alone keeps too little
(pooled cosine 0.97 on short texts, worse in padded batches): a few activations dwarf the
rest, and per-tensor scaling spends the 256 levels on them. Two kinds of outlier, two
remedies, both exact in fp32:

- A few *channels* of every LayerNorm output (the input of attention's Q/K/V projection and
  of the feed-forward's first matmul) are large for every token. Those channels are divided
  by a smoothing factor before quantization and the matching weight rows multiplied by it
  (SmoothQuant, Xiao et al. 2023). The LayerNorm output also feeds the residual, so the
  division is a Mul node of its own.
- At the feed-forward's second matmul of the early layers one token ([CLS]) is many times
  larger than the rest, in one or two channels. Those channels are taken out of the int8
  matmul and multiplied in fp32 beside it (LLM.int8()'s decomposition, Dettmers et al.
  2022). Should that miss the parity gate, those matmuls stay fp32 instead: slower, closer.

The factors and ranges come from calibration texts (int8_texts.CALIBRATION_TEXTS), run one
at a time and in padded batches, since padding rows are part of every batch served; the
parity recorded in the manifest is measured on other texts (int8_texts.PARITY_TEXTS). An
embedder's gate is the pooled cosine of each text (`EmbeddingGate`); a reranker's, the
difference of each pair's score, its pairs made of consecutive texts (`ScoreGate`).
"""

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.onnx_model import ONNXModel
from tokenizers import Tokenizer

from attnserve.artifact import ACTIVATIONS, LOGITS_OUTPUT, TOKEN_TYPES, Parity, ScoreParity, pooled_output
from attnserve.export.graph_files import remove, save, scratch
from attnserve.export.int8_texts import CALIBRATION_TEXTS, PARITY_TEXTS
from attnserve.export.onnx_graphs import POOL_SCOPE
from attnserve.export.verify import beside, session

log = logging.getLogger("attnserve.export")

INT8_MIN_COSINE = 0.99
# A scorer's int8 scores may differ from fp32's by at most this on any pair: a fiftieth of
# the range of a sigmoid or a softmax (a regression's raw values are held to it as they are).
INT8_MAX_SCORE_ERROR = 0.02
# SmoothQuant's migration strength: 0.5 splits each channel's range evenly between the
# activation and the weight (measured on MiniLM: 0.3 and 0.7 keep less).
SMOOTHING_ALPHA = 0.5
# A matmul whose input has a token this many times the median token's range (max |value|)
# gets its outlier channels split off. MiniLM: 6.5 to 9.0 at the second feed-forward matmul
# of layers 0-3 (quantized plainly, each costs 0.005 to 0.03 of pooled cosine), at most 5.1
# elsewhere.
MAX_TOKEN_RANGE_RATIO = 6.0
# Which channels are split off: those reaching this many times the median token's range
# (MiniLM: 1 to 9 of 1536; measured pooled cosine min 0.9913, against 0.9904 for the 1 or 2
# channels over MAX_TOKEN_RANGE_RATIO and 0.9919 for a fixed 4). While they are at most
# MAX_OUTLIER_SHARE of the input's channels; past it the matmul stays fp32.
OUTLIER_FACTOR = 2.0
MAX_OUTLIER_SHARE = 0.05
# Parity is measured one text at a time and in padded batches of this many (texts in their
# fixed order, so short and long share a batch), as the server batches them.
PARITY_BATCH = 16
CALIBRATION_BATCH = 8
# Inputs of these are smoothed (the op types the transformer optimiser leaves in a graph).
_LAYER_NORMS = ("LayerNormalization", "SimplifiedLayerNormalization")


class Int8ParityError(RuntimeError):
    """A quantized graph disagrees with fp32 more than the gate allows."""


@dataclass(frozen=True)
class QuantizedGraph:
    parity: Parity | ScoreParity
    quantized: int
    """matmuls (and fused Attention nodes) computed in int8"""
    split: int
    """of those, how many have outlier channels multiplied in fp32 beside them"""
    kept_fp32: int
    """matmuls left in fp32 for their token range"""


@dataclass(frozen=True)
class _Stats:
    channel_max: np.ndarray
    """largest |value| of each channel"""
    token_max: float
    """largest |value| of any token"""
    token_median: float
    """the median over tokens of each token's largest |value|"""

    @property
    def ratio(self) -> float:
        return self.token_max / max(self.token_median, 1e-12)


class _Site(NamedTuple):
    """A node to quantize, by name: its op and the activation it multiplies."""

    name: str
    op_type: str
    input: str


Row = tuple[np.ndarray, np.ndarray | None]
"""a sequence's ids, and its token types (None where the graph takes none)"""


def encode_texts(tokenizer: Path, texts: tuple[str, ...], max_positions: int, pairs: bool = False,
                 token_types: bool = False) -> list[Row]:
    """Each text tokenized, or with `pairs` each text and the next as a (query, text) pair."""
    # The bundled tokenizer.json pads and truncates to 128 tokens; cut at the model's
    # positions instead (keeping [SEP]) so long texts reach the lengths served.
    tok = Tokenizer.from_file(str(tokenizer))
    tok.no_padding()
    tok.enable_truncation(max_positions)
    inputs = [(text, texts[(i + 1) % len(texts)]) for i, text in enumerate(texts)] if pairs else list(texts)
    return [(np.asarray(e.ids, dtype=np.int64),
             np.asarray(e.type_ids, dtype=np.int64) if token_types else None)
            for e in tok.encode_batch(inputs)]


def _padded(rows: list[Row], pad_id: int) -> dict[str, np.ndarray]:
    length = max(len(ids) for ids, _ in rows)
    ids = np.full((len(rows), length), pad_id, dtype=np.int64)
    mask, types = np.zeros_like(ids), np.zeros_like(ids)
    for i, (r, t) in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
        if t is not None:
            types[i, : len(t)] = t
    typed = {TOKEN_TYPES: types} if rows[0][1] is not None else {}
    return {"input_ids": ids, "attention_mask": mask} | typed


def _feeds(rows: list[Row], batch: int, pad_id: int) -> Iterator[dict[str, np.ndarray]]:
    for r in rows:
        yield _padded([r], pad_id)
    for start in range(0, len(rows), batch):
        yield _padded(rows[start:start + batch], pad_id)


def _sites(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """What dynamic quantization turns into int8: fused Attention (its Q/K/V weights) and
    matmuls whose second input is a weight, not an activation (QKᵀ, probabilities·V),
    outside the pooling (the Dense layers', which stay float32)."""
    weights = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if not n.name.startswith(POOL_SCOPE) and (
        n.op_type == "Attention" or (n.op_type == "MatMul" and n.input[1] in weights))]


def _activation_stats(graph: Path, names: list[str], feeds: list[dict]) -> dict[str, _Stats]:
    """Each tensor of `names` of the graph saved at `graph`, over `feeds`: its largest
    |value| per channel, and the largest and the median over tokens of a token's largest.
    Both are computed in the graph right after the tensor is made: the activations
    themselves never leave onnxruntime, nor outlive their use in it (all of Qwen3-0.6B's at
    once passed 20 GB). The probe's weights stay where `graph` keeps them."""
    probe = onnx.load(str(graph), load_external_data=False)
    wanted = set(names)
    probe.graph.initializer.extend(
        helper.make_tensor(name, onnx.TensorProto.INT64, [1], [value]) for name, value in
        (("probe/minus_one", -1), ("probe/last", -1), ("probe/end", np.iinfo(np.int64).max)))
    nodes = []
    for node in probe.graph.node:
        nodes.append(node)
        for name in (out for out in node.output if out in wanted):
            tag = f"probe/{name}"
            nodes += [
                helper.make_node("Abs", [name], [f"{tag}/abs"]),
                helper.make_node("Shape", [name], [f"{tag}/shape"]),
                helper.make_node("Slice", [f"{tag}/shape", "probe/last", "probe/end"], [f"{tag}/width"]),
                helper.make_node("Concat", ["probe/minus_one", f"{tag}/width"], [f"{tag}/2d"], axis=0),
                helper.make_node("Reshape", [f"{tag}/abs", f"{tag}/2d"], [f"{tag}/rows"]),
                helper.make_node("ReduceMax", [f"{tag}/rows"], [f"{name}/channel_max"], axes=[0], keepdims=0),
                helper.make_node("ReduceMax", [f"{tag}/rows"], [f"{name}/token_max"], axes=[1], keepdims=0),
            ]
    del probe.graph.node[:]
    probe.graph.node.extend(nodes)
    # Its own outputs only: the graph's (an attention graph's maps) would be held to the end.
    outputs = [f"{name}/{kind}" for name in names for kind in ("channel_max", "token_max")]
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in outputs)
    with beside(graph, probe) as path:
        runner = session(path)
    del probe
    runs = [dict(zip(outputs, runner.run(outputs, feed), strict=True)) for feed in feeds]
    stats = {}
    for name in names:
        tokens = np.concatenate([run[f"{name}/token_max"] for run in runs])
        channels = np.max([run[f"{name}/channel_max"] for run in runs], axis=0)
        stats[name] = _Stats(channels, float(tokens.max()), float(np.median(tokens)))
    return stats


def _pruned(model: onnx.ModelProto) -> onnx.ModelProto:
    """Without the initializers no node reads any more, its nodes in topological order (ONNX
    requires it; inserted nodes go at the end first); in place."""
    graph = model.graph
    used = {name for n in graph.node for name in n.input}
    kept = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    wrapped = ONNXModel(model)
    wrapped.topological_sort()
    return wrapped.model


def _smooth(model: onnx.ModelProto, stats: dict[str, _Stats]) -> onnx.ModelProto:
    """In place: divide the LayerNorm outputs that feed quantized sites by per-channel factors
    (one Mul per tensor, shared by its sites) and multiply the sites' weight rows by the same."""
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    by_input: dict[str, list[onnx.NodeProto]] = {}
    for node in _sites(model):
        source = producer.get(node.input[0])
        if source is not None and source.op_type in _LAYER_NORMS:
            by_input.setdefault(node.input[0], []).append(node)
    muls = []
    for index, (tensor, sites) in enumerate(by_input.items()):
        rows = [numpy_helper.to_array(weights[s.input[1]]) for s in sites]
        factor = _smoothing_factor(stats[tensor].channel_max, np.concatenate(rows, axis=1))
        inverse, smoothed = f"smooth_{index}_inverse", f"smooth_{index}_output"
        graph.initializer.append(numpy_helper.from_array(1 / factor, inverse))
        muls.append(helper.make_node("Mul", [tensor, inverse], [smoothed], name=f"Smooth_{index}"))
        for site, w in zip(sites, rows, strict=True):
            scaled = f"{site.input[1]}_smoothed_{index}"
            graph.initializer.append(numpy_helper.from_array(w * factor[:, None], scaled))
            site.input[0], site.input[1] = smoothed, scaled
    graph.node.extend(muls)
    return _pruned(model)


def _smoothing_factor(channel_max: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Per input channel of `weights` ([in, out]): SmoothQuant's s = max|x|^α / max|w|^(1-α)."""
    return (np.clip(channel_max, 1e-5, None) ** SMOOTHING_ALPHA
            / np.clip(np.abs(weights).max(axis=1), 1e-5, None) ** (1 - SMOOTHING_ALPHA)).astype(np.float32)


def _split_outliers(model: onnx.ModelProto, outliers: dict[str, np.ndarray], stats: dict[str, _Stats]
                    ) -> tuple[onnx.ModelProto, list[str]]:
    """For each matmul named in `outliers`: y = x·W becomes (x/s, those channels zeroed)·(s·W),
    to be quantized, plus x[..., outliers]·W[outliers], a small fp32 matmul. The smoothing s
    rides on the mask's Mul, so it costs nothing more. In place; returns the model and the
    names of the fp32 matmuls (to keep out of quantization)."""
    graph = model.graph
    weights = {i.name: i for i in graph.initializer}
    added, fp32 = [], []
    for node in [n for n in graph.node if n.name in outliers]:
        x, y, w = node.input[0], node.output[0], numpy_helper.to_array(weights[node.input[1]])
        index = outliers[node.name].astype(np.int64)
        rest_max = stats[x].channel_max.copy()
        rest_max[index] = 0
        factor = _smoothing_factor(rest_max, w)
        keep = 1 / factor
        keep[index] = 0
        tag = f"outliers_{len(fp32)}"
        graph.initializer.extend([numpy_helper.from_array(keep, f"{tag}_keep"),
                                  numpy_helper.from_array(w * factor[:, None], f"{tag}_int8_weight"),
                                  numpy_helper.from_array(index, f"{tag}_index"),
                                  numpy_helper.from_array(w[index], f"{tag}_weight")])
        added += [
            helper.make_node("Mul", [x, f"{tag}_keep"], [f"{tag}_rest"], name=f"{tag}_Mask"),
            helper.make_node("Gather", [x, f"{tag}_index"], [f"{tag}_x"], axis=-1, name=f"{tag}_Gather"),
            helper.make_node("MatMul", [f"{tag}_x", f"{tag}_weight"], [f"{tag}_y"], name=f"{tag}_MatMul"),
            helper.make_node("Add", [f"{tag}_int8_y", f"{tag}_y"], [y], name=f"{tag}_Add"),
        ]
        node.input[0], node.input[1], node.output[0] = f"{tag}_rest", f"{tag}_int8_weight", f"{tag}_int8_y"
        fp32.append(f"{tag}_MatMul")
    graph.node.extend(added)
    return _pruned(model), fp32


def _quantize(source: Path, target: Path, exclude: list[str]) -> None:
    """The graph in `source` quantized into `target`. Given a file, the quantizer holds one
    copy of the graph besides its own work (given a graph in memory, it copies it twice)."""
    # The quantizer warns that the model was not "pre-processed" (shape inference it does not
    # need here: every quantized weight is a constant of known shape).
    logging.disable(logging.WARNING)
    try:
        with scratch(target.parent) as directory:
            # Written with its data beside it whatever its size, then kept as graph_files
            # saves every graph of the artifact.
            written = directory / target.name
            # Shape inference cannot type the outputs of com.microsoft ops (fused Attention,
            # BiasGelu); they are all float (DefaultTensorType).
            quantize_dynamic(source, written, op_types_to_quantize=["MatMul", "Attention"], per_channel=True,
                             weight_type=QuantType.QInt8, nodes_to_exclude=exclude,
                             use_external_data_format=True, extra_options={
                                 "MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
            save(onnx.load(str(written)), target)
    finally:
        logging.disable(logging.NOTSET)


def pooled_cosines(fp32: Path, int8: Path, tokenizer: Path, max_positions: int, pad_id: int,
                   pooling: str = "mean") -> np.ndarray:
    """Per text of PARITY_TEXTS, the worse of two cosines between the graphs' pooled
    (`pooling`, L2-normalised) embeddings: the text alone, and in a padded batch (texts in
    their fixed order, so short and long share one), as the server runs them."""
    rows = encode_texts(tokenizer, PARITY_TEXTS, max_positions)
    name = pooled_output(pooling, normalized=True)
    reference, quantized = session(fp32, outputs=[name]), session(int8, "int8", outputs=[name])
    cosines = np.concatenate([(reference.run([name], feed)[0] * quantized.run([name], feed)[0]).sum(axis=1)
                              for feed in _feeds(rows, PARITY_BATCH, pad_id)])
    return np.minimum(cosines[: len(rows)], cosines[len(rows):])


@dataclass(frozen=True)
class EmbeddingGate:
    """Each text's pooled cosine against fp32 at least `min_cosine`, pooled as the model
    pools (`pooling`): a last token's vector loses more to int8 than a mean."""

    tokenizer: Path
    max_positions: int
    pad_id: int
    min_cosine: float = INT8_MIN_COSINE
    pooling: str = "mean"

    def calibration(self) -> list[dict[str, np.ndarray]]:
        return list(_feeds(encode_texts(self.tokenizer, CALIBRATION_TEXTS, self.max_positions),
                           CALIBRATION_BATCH, self.pad_id))

    def measure(self, reference: Path, target: Path) -> np.ndarray:
        return pooled_cosines(reference, target, self.tokenizer, self.max_positions, self.pad_id,
                              self.pooling)

    def passes(self, values: np.ndarray) -> bool:
        return bool(values.min() >= self.min_cosine)

    def parity(self, values: np.ndarray, reference: Path) -> Parity:
        return Parity(reference=reference.name, texts=len(values), batch=PARITY_BATCH,
                      pooled_cosine_min=round(float(values.min()), 5),
                      pooled_cosine_mean=round(float(values.mean()), 5), min_cosine=self.min_cosine,
                      pooling=self.pooling)

    def refusal(self, values: np.ndarray, target: Path, reference: Path) -> str:
        return (f"{target.name}: {self.pooling}-pooled cosine against {reference.name} is "
                f"{values.min():.4f} at worst over {len(values)} texts (one at a time and in batches of "
                f"{PARITY_BATCH}), below the required {self.min_cosine}; worst text: "
                f"{PARITY_TEXTS[int(values.argmin())][:60]!r}")


@dataclass(frozen=True)
class ScoreGate:
    """Each pair's scores, as served (`activation`: a reranker's sigmoid, a classifier's
    activation), within `max_error` of fp32's."""

    tokenizer: Path
    max_positions: int
    pad_id: int
    token_types: bool
    activation: str
    max_error: float = INT8_MAX_SCORE_ERROR

    def calibration(self) -> list[dict[str, np.ndarray]]:
        return list(_feeds(encode_texts(self.tokenizer, CALIBRATION_TEXTS, self.max_positions, True,
                                        self.token_types), CALIBRATION_BATCH, self.pad_id))

    def measure(self, reference: Path, target: Path) -> np.ndarray:
        """Per pair of PARITY_TEXTS (each text and the next), its largest score difference
        between the graphs over its labels, the worse of the pair alone and in a padded batch."""
        rows = encode_texts(self.tokenizer, PARITY_TEXTS, self.max_positions, True, self.token_types)
        fp32, int8 = session(reference), session(target, "int8")
        scores = ACTIVATIONS[self.activation]
        errors = np.concatenate([np.abs(scores(fp32.run([LOGITS_OUTPUT], feed)[0])
                                        - scores(int8.run([LOGITS_OUTPUT], feed)[0])).max(axis=1)
                                 for feed in _feeds(rows, PARITY_BATCH, self.pad_id)])
        return np.maximum(errors[: len(rows)], errors[len(rows):])

    def passes(self, values: np.ndarray) -> bool:
        return bool(values.max() <= self.max_error)

    def parity(self, values: np.ndarray, reference: Path) -> ScoreParity:
        return ScoreParity(reference=reference.name, pairs=len(values), batch=PARITY_BATCH,
                           score_error_max=round(float(values.max()), 5),
                           score_error_mean=round(float(values.mean()), 5), max_error=self.max_error)

    def refusal(self, values: np.ndarray, target: Path, reference: Path) -> str:
        worst = int(values.argmax())
        return (f"{target.name}: scores differ from {reference.name}'s by up to "
                f"{values.max():.4f} over {len(values)} pairs (one at a time and in batches of "
                f"{PARITY_BATCH}), over the allowed {self.max_error}; worst pair: "
                f"{PARITY_TEXTS[worst][:40]!r} with {PARITY_TEXTS[(worst + 1) % len(PARITY_TEXTS)][:40]!r}")


# What a quantized graph must keep of its fp32 reference, measured per item (a text or a
# pair) of fixed parity inputs.
Gate = EmbeddingGate | ScoreGate


def quantize_graph(source: Path, reference: Path, target: Path, gate: Gate) -> QuantizedGraph:
    """Write the int8 version of the optimised fp32 graph `source`, or raise Int8ParityError
    (leaving no `target`) when it does not pass `gate` against the artifact's fp32 graph
    `reference` (the same outputs). One copy of the graph is in memory at a time (Qwen3-0.6B's
    is 2.4 GB); between the steps it waits in a scratch file."""
    calibration = gate.calibration()
    with scratch(target.parent) as directory:
        model = onnx.load(str(source))
        stats = _activation_stats(source, sorted({n.input[0] for n in _sites(model)}), calibration)
        _smooth(model, stats)
        # Names only: a node held keeps its whole graph in memory.
        sites = [_Site(n.name, n.op_type, n.input[0]) for n in _sites(model)]
        # The Dense layers' matmuls stay float32: they run once a pooled vector, where int8
        # would save nothing and cost the served vector precision.
        pooling = [n.name for n in model.graph.node
                   if n.op_type == "MatMul" and n.name.startswith(POOL_SCOPE)]
        smoothed = directory / "smoothed.onnx"
        save(model, smoothed)
        del model
        stats = _activation_stats(smoothed, sorted({site.input for site in sites}), calibration)
        values, split, fp32 = _quantize_gated(smoothed, sites, stats, reference, target, gate, pooling)
    parity = gate.parity(values, reference)
    result = QuantizedGraph(parity, len(sites) - len(fp32), len(split), len(fp32))
    log.info("event=quantized graph=%s int8=%d split=%d fp32=%d parity=%r", target.name,
             result.quantized, result.split, result.kept_fp32, parity)
    if not gate.passes(values):
        remove(target)
        raise Int8ParityError(gate.refusal(values, target, reference))
    return result


def _quantize_gated(smoothed: Path, sites: list[_Site], stats: dict[str, _Stats],
                    reference: Path, target: Path, gate: Gate, pooling: list[str]
                    ) -> tuple[np.ndarray, dict[str, np.ndarray], list[str]]:
    """Quantize the smoothed graph into `target`, the matmuls with outlier tokens split (or,
    should that miss the gate, kept fp32); returns the gate's measure, the split and fp32 ones."""
    split: dict[str, np.ndarray] = {}
    fp32: list[str] = []
    for site in sites:
        input_stats = stats[site.input]
        if input_stats.ratio <= MAX_TOKEN_RANGE_RATIO:
            continue
        outliers = np.flatnonzero(input_stats.channel_max > OUTLIER_FACTOR * input_stats.token_median)
        if site.op_type == "MatMul" and len(outliers) <= MAX_OUTLIER_SHARE * len(input_stats.channel_max):
            split[site.name] = outliers
        else:
            fp32.append(site.name)

    def attempt(split: dict[str, np.ndarray], fp32: list[str]) -> np.ndarray:
        prepared, outlier_matmuls = smoothed, []
        if split:
            model, outlier_matmuls = _split_outliers(onnx.load(str(smoothed)), split, stats)
            prepared = smoothed.with_name("split.onnx")
            save(model, prepared)
            del model
        _quantize(prepared, target, fp32 + outlier_matmuls + pooling)
        return gate.measure(reference, target)

    values = attempt(split, fp32)
    if split and not gate.passes(values):
        log.warning("event=int8_fallback graph=%s parity=%r reason='outlier split below the "
                    "gate; those matmuls stay fp32'", target.name, gate.parity(values, reference))
        fp32, split = fp32 + list(split), {}
        values = attempt(split, fp32)
    return values, split, fp32
