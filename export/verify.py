"""Check an exported graph before it is allowed into an artifact: the ONNX checker, then
onnxruntime against PyTorch at shapes the tracer never saw."""

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from attnserve.artifact import (
    DENSE_INPUT,
    DENSE_OUTPUT,
    LOGITS_OUTPUT,
    TOKEN_OUTPUTS,
    TOKEN_TYPES,
    cpu_session_config,
)
from attnserve.export.onnx_graphs import GraphOutputs, Heads, ScoreOutputs, output_names
from attnserve.model import AnyEncoder, CrossEncoder

# Lengths other than the tracing length (7), including 1 and the model's maximum, so a
# graph that baked a shape in fails here.
PARITY_SEQ_LENS = (1, 2, 17, 128, 512)
PARITY_BATCHES = (1, 4)


def _register_rms_norm() -> None:
    """onnxruntime's fused RMSNorm, SimplifiedLayerNormalization, sits in the ONNX domain
    without being an ONNX operator; its schema, registered for the checker, lets it check
    the graph around it (onnxruntime's optimiser writes it for Qwen3's and Gemma3's norms)."""
    if onnx.defs.has("SimplifiedLayerNormalization"):
        return
    schema, types = onnx.defs.OpSchema, ["tensor(float)", "tensor(float16)", "tensor(double)",
                                         "tensor(bfloat16)"]
    optional = schema.FormalParameterOption.Optional
    onnx.defs.register_schema(schema(
        "SimplifiedLayerNormalization", "", 1, doc="onnxruntime's RMSNorm",
        inputs=[schema.FormalParameter("X", "T"), schema.FormalParameter("scale", "V")],
        outputs=[schema.FormalParameter("Y", "V"),
                 schema.FormalParameter("inv_std_var", "U", param_option=optional)],
        type_constraints=[("T", types, ""), ("V", types, ""), ("U", ["tensor(float)", "tensor(double)"], "")],
        attributes=[schema.Attribute(name, kind, "", required=False) for name, kind in (
            ("axis", schema.AttrType.INT), ("epsilon", schema.AttrType.FLOAT),
            ("stash_type", schema.AttrType.INT))]))


@contextmanager
def beside(graph: Path, model: onnx.ModelProto) -> Iterator[Path]:
    """`model`, a variant of the graph saved at `graph` whose weights it reads from where
    `graph` keeps them (loaded without its external data), saved beside it while in use."""
    path = graph.with_name(f".variant-{graph.name}")
    onnx.save_model(model, str(path))
    try:
        yield path
    finally:
        path.unlink()


def check_onnx(path: Path) -> None:
    _register_rms_norm()
    onnx.checker.check_model(str(path), full_check=True)


def parity_inputs(vocab_size: int, max_positions: int, seed: int = 0,
                  token_types: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Random token ids; in batches of 4 the rows have different real lengths, so
    padding is exercised; with `token_types`, each row's second half is segment 1."""
    rng = np.random.default_rng(seed)
    for seq in (s for s in PARITY_SEQ_LENS if s <= max_positions):
        for batch in PARITY_BATCHES:
            ids = rng.integers(0, vocab_size, size=(batch, seq), dtype=np.int64)
            mask = np.ones((batch, seq), dtype=np.int64)
            for row in range(1, batch):
                mask[row, max(1, seq - row * seq // batch):] = 0
            feed = {"input_ids": ids, "attention_mask": mask}
            if token_types:
                lengths = mask.sum(axis=1, keepdims=True)
                feed[TOKEN_TYPES] = ((np.arange(seq) >= lengths // 2) & mask.astype(bool)).astype(np.int64)
            yield feed


def session(graph: Path, precision: str = "fp32", outputs: list[str] | None = None) -> ort.InferenceSession:
    """A CPU session with the config the server runs a graph of `precision` with
    (artifact.cpu_session_config: for int8, its exact integer arithmetic). `outputs`: the
    graph's outputs to keep (an attention graph's maps are graph outputs, which onnxruntime
    holds to the end of every run: 28 layers of them for 16 texts of 900 tokens passed 20 GB)."""
    if outputs is not None:
        trimmed = onnx.load(str(graph), load_external_data=False)
        kept = [o for o in trimmed.graph.output if o.name in outputs]
        del trimmed.graph.output[:]
        trimmed.graph.output.extend(kept)
        with beside(graph, trimmed) as path:
            return session(path, precision)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for key, value in cpu_session_config(precision).items():
        options.add_session_config_entry(key, value)
    return ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])


def served(name: str, value: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """What a caller can get of an output: the pooled vectors whole, the outputs of one row
    a token (the hidden state, token weights and vectors) and the attention rows of real
    tokens only (the server trims the padding away). A padded query of a local ModernBERT
    layer sees no key at all: its row is whatever the softmax makes of blocked scores,
    which differs between precisions and serves nobody."""
    real = mask.astype(bool)
    if name in TOKEN_OUTPUTS:
        return value[real]
    if name.startswith("attentions."):
        return np.moveaxis(value, 2, 1)[real]  # (batch, heads, q, k) -> (real q, heads, k)
    return value


Expected = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]
"""a parity input's feed, and the model's outputs by name"""


class Reference:
    """What the PyTorch model answers over the parity inputs, that every graph exported from
    it is held to; `dense`, `heads`: an embedder's Dense layers and heads. The outputs without
    maps are computed once for every graph that returns them (fp32, fused, fp16, int8): one
    pass of the model over the parity inputs takes seconds, a large model's minutes on a
    small CPU. Maps, hundreds of MiB, are computed again for each graph that returns them."""

    def __init__(self, model: AnyEncoder | CrossEncoder, dense: nn.Module | None = None,
                 heads: Heads | None = None):
        self.model, self.dense, self.heads = model, dense, heads
        self.kept: dict[bool, list[Expected]] = {}
        """by whether the feeds carry token types: the outputs without maps"""

    def expected(self, attention: bool, token_types: bool) -> Iterable[Expected]:
        if attention:  # a parity input's maps at a time
            return self._run(attention, token_types)
        if token_types not in self.kept:
            self.kept[token_types] = list(self._run(attention, token_types))
        return self.kept[token_types]

    def _run(self, attention: bool, token_types: bool) -> Iterator[Expected]:
        # The module that was traced: every output, pooled vectors included, in its place.
        if isinstance(self.model, CrossEncoder):
            module, names = ScoreOutputs(self.model).eval(), [LOGITS_OUTPUT]
        else:
            module = GraphOutputs(self.model, attention, self.dense, self.heads).eval()
            names = output_names(self.model, attention, self.heads)
        config = self.model.config
        for feed in parity_inputs(config.vocab_size, config.max_positions, token_types=token_types):
            with torch.no_grad():
                values = module(*map(torch.from_numpy, feed.values()))
            yield feed, {name: value.numpy() for name, value in zip(names, values, strict=True)}


def max_abs_error(path: Path, reference: Reference, outputs: list[str], precision: str = "fp32") -> float:
    """Worst absolute difference between onnxruntime and PyTorch over the parity shapes, in
    what is served (`served`)."""
    sess = session(path, precision)
    token_types = TOKEN_TYPES in [i.name for i in sess.get_inputs()]
    attention = any(name.startswith("attentions.") for name in outputs)
    worst = 0.0
    for feed, expected in reference.expected(attention, token_types):
        mask = feed["attention_mask"]
        for name, got in zip(outputs, sess.run(outputs, feed), strict=True):
            if got.shape != (want := expected[name]).shape:
                raise RuntimeError(f"{path.name}: {name} has shape {got.shape}, PyTorch {want.shape}")
            error = float(np.abs(served(name, got.astype(np.float32), mask) - served(name, want, mask)).max())
            # A NaN compares false with everything: max() would keep the last finite worst.
            worst = max(worst, error) if np.isfinite(error) else math.inf
    return worst


def dense_error(path: Path, dense: nn.Module, hidden_size: int) -> float:
    """Worst absolute difference between the Dense layers' graph and PyTorch, on random
    vectors of the pooled vectors' size, one and several at a time."""
    sess = session(path)
    rng = np.random.default_rng(0)
    worst = 0.0
    for batch in PARITY_BATCHES:
        pooled = rng.standard_normal((batch, hidden_size)).astype(np.float32)
        (got,) = sess.run([DENSE_OUTPUT], {DENSE_INPUT: pooled})
        with torch.no_grad():
            want = dense(torch.from_numpy(pooled)).numpy()
        error = float(np.abs(got - want).max())
        worst = max(worst, error) if np.isfinite(error) else math.inf
    return worst
