"""Trace the PyTorch encoder into ONNX graphs with dynamic batch and sequence axes."""

from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from torch import nn

from attnserve.artifact import (
    DENSE_INPUT,
    DENSE_OUTPUT,
    HIDDEN_OUTPUT,
    INPUT_NAMES,
    LOGITS_OUTPUT,
    MULTI_VECTOR_OUTPUT,
    POOLED_OUTPUTS,
    POOLINGS,
    SPARSE_OUTPUT,
    TOKEN_TYPES,
    TOKEN_WEIGHTS_OUTPUT,
    attention_output,
)
from attnserve.export.graph_files import save, scratch
from attnserve.model import AnyEncoder, CrossEncoder, pooling
from attnserve.model.multi_vector import TokenVectors
from attnserve.model.sparse import LexicalWeights, SpladeHead

# The TorchScript exporter at opset 17: torch 2.13's default dynamo exporter writes a
# graph whose attention onnxruntime's optimiser cannot fuse, and which runs slower.
OPSET = 17
# Node names of the pooling submodule start with this (the exporter names nodes by module
# scope): optimize.py keeps those nodes in float32 inside float16 graphs.
POOL_SCOPE = "/pool/"


class Pool(nn.Module):
    """The pooled outputs, computed where the hidden state is (on the GPU under CUDA), so a
    caller who wants one vector per sequence never needs [batch, seq, hidden] copied out.
    As sentence-transformers computes them: each pooling (model/pooling.py), then the
    checkpoint's Dense layers (`dense`), each vector also L2-normalised (pooling.normalize,
    written without the Shape/Expand nodes onnxruntime may place on the CPU: a CUDA graph
    needs every node on the device).

    The poolings' vectors go through the Dense layers stacked, [poolings, batch, hidden]:
    one matmul a layer, whose weight no other node reads (onnxruntime's quantizer rewrites
    a weight in place for each reader of it)."""

    def __init__(self, dense: nn.Module):
        super().__init__()
        self.dense = dense

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pooled = torch.stack([pooling.pool(hidden, attention_mask, how) for how in POOLINGS])
        out = []
        for vector in self.dense(pooled).unbind(0):
            out += [vector, pooling.normalize(vector)]
        return tuple(out)


@dataclass
class Heads:
    """What an embedder's graphs compute from the hidden state beside it: the pooled
    vectors (or none, for a model whose vectors are others), SPLADE's sparse vector,
    bge-m3's lexical token weights, late interaction's token vectors. Each head's nodes
    sit under its own scope (/sparse/, /lexical/, /multi_vector/)."""

    pooled: bool = True
    sparse: SpladeHead | None = None
    lexical: LexicalWeights | None = None
    multi_vector: TokenVectors | None = None

    def output_names(self) -> list[str]:
        return [*(POOLED_OUTPUTS if self.pooled else ()),
                *(name for name, head in ((SPARSE_OUTPUT, self.sparse), (TOKEN_WEIGHTS_OUTPUT, self.lexical),
                                          (MULTI_VECTOR_OUTPUT, self.multi_vector)) if head)]


class GraphOutputs(nn.Module):
    """The encoder with a flat tuple of outputs, as ONNX wants them, in `output_names`'
    order; `dense`: the checkpoint's Dense layers, which every pooled vector goes through;
    `heads`: which heads (none: the pooled vectors alone)."""

    def __init__(self, encoder: AnyEncoder, attention: bool, dense: nn.Module | None = None,
                 heads: Heads | None = None):
        super().__init__()
        heads = heads or Heads()
        self.encoder = encoder
        self.attention = attention
        self.pool = Pool(nn.Sequential() if dense is None else dense) if heads.pooled else None
        self.sparse, self.lexical, self.multi_vector = heads.sparse, heads.lexical, heads.multi_vector

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.encoder(input_ids, attention_mask, output_attentions=self.attention)
        hidden = out.last_hidden_state
        outputs = [hidden, *(self.pool(hidden, attention_mask) if self.pool else ())]
        if self.sparse is not None:
            outputs.append(self.sparse(hidden, attention_mask))
        if self.lexical is not None:
            outputs.append(self.lexical(hidden, attention_mask))
        if self.multi_vector is not None:
            outputs.append(self.multi_vector(hidden))
        return (*outputs, *(out.attentions if self.attention else ()))


def output_names(encoder: AnyEncoder, attention: bool, heads: Heads | None = None) -> list[str]:
    names = [HIDDEN_OUTPUT, *(heads or Heads()).output_names()]
    if attention:
        names += [attention_output(i) for i in range(encoder.config.num_layers)]
    return names


class ScoreOutputs(nn.Module):
    """A cross-encoder as its graph: (query, text) pairs in, with their token types where
    the family has them, one row of logits a pair out."""

    def __init__(self, model: CrossEncoder):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        return (self.model(input_ids, attention_mask, token_type_ids),)


def score_inputs(model: CrossEncoder) -> tuple[str, ...]:
    return (*INPUT_NAMES, TOKEN_TYPES) if model.uses_token_types else INPUT_NAMES


def _tracing_inputs(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # A shape no test uses, so a graph that baked in the tracing shape fails the parity
    # checks at other lengths instead of passing by coincidence.
    batch, seq = 3, 7
    input_ids = torch.randint(0, vocab_size, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.int64)
    attention_mask[1, 5:] = 0
    return input_ids, attention_mask


def _trace(module: nn.Module, args: tuple[torch.Tensor, ...], path: Path, inputs: list[str],
           outputs: list[str], dynamic: dict[str, dict[int, str]]) -> None:
    """Trace `module` into `path` (graph_files.save: its weights beside it past 2 GB)."""
    with scratch(path.parent) as directory, torch.no_grad():
        traced = directory / path.name
        torch.onnx.export(module.eval(), args, str(traced), input_names=inputs,
                          output_names=outputs, dynamic_axes=dynamic, opset_version=OPSET, dynamo=False)
        save(onnx.load(str(traced)), path)


def export_scores(model: CrossEncoder, path: Path) -> list[str]:
    input_ids, attention_mask = _tracing_inputs(model.config.vocab_size)
    inputs = score_inputs(model)
    args: tuple[torch.Tensor, ...] = (input_ids, attention_mask)
    if TOKEN_TYPES in inputs:
        args += ((torch.arange(input_ids.shape[1]) >= 3).long().expand_as(input_ids).contiguous(),)
    dynamic = {name: {0: "batch", 1: "seq"} for name in inputs} | {LOGITS_OUTPUT: {0: "batch"}}
    _trace(ScoreOutputs(model), args, path, list(inputs), [LOGITS_OUTPUT], dynamic)
    return [LOGITS_OUTPUT]


def export_graph(encoder: AnyEncoder, path: Path, attention: bool,
                 dense: nn.Module | None = None, heads: Heads | None = None) -> list[str]:
    outputs = output_names(encoder, attention, heads)
    dynamic = {name: {0: "batch", 1: "seq"} for name in (*INPUT_NAMES, HIDDEN_OUTPUT,
                                                          TOKEN_WEIGHTS_OUTPUT, MULTI_VECTOR_OUTPUT)}
    dynamic |= {name: {0: "batch"} for name in (*POOLED_OUTPUTS, SPARSE_OUTPUT)}
    dynamic |= {attention_output(i): {0: "batch", 2: "seq", 3: "seq"}
                for i in range(encoder.config.num_layers) if attention}
    dynamic = {name: axes for name, axes in dynamic.items() if name in (*INPUT_NAMES, *outputs)}
    _trace(GraphOutputs(encoder, attention, dense, heads),
           _tracing_inputs(encoder.config.vocab_size), path, list(INPUT_NAMES), outputs, dynamic)
    return outputs


def export_dense(dense: nn.Module, hidden_size: int, path: Path) -> None:
    """Write the graph of the Dense layers alone, pooled vectors in, the vectors after every
    layer out: what the server runs on a vector it pooled itself."""
    _trace(dense, (torch.randn(3, hidden_size),), path, [DENSE_INPUT], [DENSE_OUTPUT],
           {DENSE_INPUT: {0: "batch"}, DENSE_OUTPUT: {0: "batch"}})
