"""Trace the PyTorch encoder into ONNX graphs with dynamic batch and sequence axes."""

from pathlib import Path

import torch
from torch import nn

from attnserve.artifact import (
    HIDDEN_OUTPUT,
    INPUT_NAMES,
    LOGITS_OUTPUT,
    POOLED_OUTPUTS,
    POOLINGS,
    TOKEN_TYPES,
    attention_output,
)
from attnserve.model import AnyEncoder, CrossEncoder

# The TorchScript exporter at opset 17: torch 2.13's default dynamo exporter writes a
# graph whose attention onnxruntime's optimiser cannot fuse, and which runs slower.
OPSET = 17
# Node names of the pooling submodule start with this (the exporter names nodes by module
# scope): optimize.py keeps those nodes in float32 inside float16 graphs.
POOL_SCOPE = "/pool/"


class Pool(nn.Module):
    """The pooled outputs, computed where the hidden state is (on the GPU under CUDA), so a
    caller who wants one vector per sequence never needs [batch, seq, hidden] copied out.
    As sentence-transformers pools: mean over the tokens the mask keeps (the count clamped
    away from zero, so a row of padding only pools to zeros), or the first token; each
    also L2-normalised as torch.nn.functional.normalize does (the norm clamped at 1e-12),
    written out so the graph has no Shape/Expand nodes, which onnxruntime may place on the
    CPU (a CUDA graph needs every node on the device)."""

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        count = weights.sum(dim=1).clamp(min=1e-9)
        pooled = {"mean": (hidden * weights).sum(dim=1) / count, "cls": hidden[:, 0]}
        out = []
        for name in POOLINGS:
            vector = pooled[name]
            out += [vector, vector / vector.norm(p=2, dim=1, keepdim=True).clamp(min=1e-12)]
        return tuple(out)


class GraphOutputs(nn.Module):
    """The encoder with a flat tuple of outputs, as ONNX wants them, in `output_names`'
    order: the hidden state, the pooled vectors, then the attention maps."""

    def __init__(self, encoder: AnyEncoder, attention: bool):
        super().__init__()
        self.encoder = encoder
        self.attention = attention
        self.pool = Pool()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        out = self.encoder(input_ids, attention_mask, output_attentions=self.attention)
        pooled = self.pool(out.last_hidden_state, attention_mask)
        return (out.last_hidden_state, *pooled, *(out.attentions if self.attention else ()))


def output_names(encoder: AnyEncoder, attention: bool) -> list[str]:
    names = [HIDDEN_OUTPUT, *POOLED_OUTPUTS]
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


def export_scores(model: CrossEncoder, path: Path) -> list[str]:
    """Write the fp32 scores graph of a cross-encoder; returns its output names."""
    input_ids, attention_mask = _tracing_inputs(model.config.vocab_size)
    inputs = score_inputs(model)
    args: tuple[torch.Tensor, ...] = (input_ids, attention_mask)
    if TOKEN_TYPES in inputs:
        args += ((torch.arange(input_ids.shape[1]) >= 3).long().expand_as(input_ids).contiguous(),)
    dynamic = {name: {0: "batch", 1: "seq"} for name in inputs} | {LOGITS_OUTPUT: {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(ScoreOutputs(model).eval(), args, str(path), input_names=list(inputs),
                          output_names=[LOGITS_OUTPUT], dynamic_axes=dynamic,
                          opset_version=OPSET, dynamo=False)
    return [LOGITS_OUTPUT]


def export_graph(encoder: AnyEncoder, path: Path, attention: bool) -> list[str]:
    """Write one fp32 graph; returns its output names."""
    outputs = output_names(encoder, attention)
    input_ids, attention_mask = _tracing_inputs(encoder.config.vocab_size)
    dynamic = {name: {0: "batch", 1: "seq"} for name in (*INPUT_NAMES, HIDDEN_OUTPUT)}
    dynamic |= {name: {0: "batch"} for name in POOLED_OUTPUTS}
    dynamic |= {attention_output(i): {0: "batch", 2: "seq", 3: "seq"}
                for i in range(encoder.config.num_layers) if attention}
    with torch.no_grad():
        torch.onnx.export(
            GraphOutputs(encoder, attention).eval(),
            (input_ids, attention_mask),
            str(path),
            input_names=list(INPUT_NAMES),
            output_names=outputs,
            dynamic_axes=dynamic,
            opset_version=OPSET,
            dynamo=False,
        )
    return outputs
