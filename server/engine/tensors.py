"""Raw tensor inference: the model's own inputs run as sent, its outputs answered as tensors.

The inputs are the graph's: input_ids and attention_mask, int64 [batch, seq], each row's mask ones then zeros
(and a BERT reranker's token_type_ids, each row zeros then ones over its length). The outputs are those
`ServedModel.output_layers` names: an embedder's hidden state, every layer's attention maps stacked, or one
layer's; a reranker's logits. Each row is zero past its length, so no computed padding reaches the caller.
Everything that can be checked from the declared shapes is checked before any of the data is read."""

from collections.abc import Sequence
from typing import Any

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, LOGITS_OUTPUT, SCORERS, TOKEN_TYPES
from attnserve.server.engine.model import ALL_ATTENTIONS, ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, ID_SEQUENCE_S, TOKEN_ID_S
from attnserve.server.engine.requests import InputTensor, Shapes, Submission, TensorRequest
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.memory.ledger import Holds
from attnserve.server.runtime.backend import SequenceResult

# An input tensor's values (not raw bytes) are read this many at a time.
VALUES_SLICE = 1 << 16


async def run(model: ServedModel, request: TensorRequest, holds: Holds, deadline: float | None) -> Any:
    """The door's answer (`request.answer.respond`) with the outputs asked for, (name, float32 array) in the
    order asked for."""
    model.check_serving()
    batch, seq = _input_shape(model, request.inputs)
    names, layers = _output_names(model, request.outputs)
    model.scheduler.admit(batch, at_least=True)
    shapes = [(name, model.output_shape(name, layers, batch, seq)) for name in names]
    response_bytes = request.answer.size(shapes).check(np.zeros(0, np.int64))
    with model.stage("tokenize"):
        sequences, lengths, segments = await model.offload.request(
            batch * (ID_SEQUENCE_S + seq * len(model.manifest.inputs) * TOKEN_ID_S), _rows,
            model, request.inputs, batch, seq)
    outputs = frozenset({LOGITS_OUTPUT if model.kind in SCORERS else HIDDEN_OUTPUT})
    results = await model.run(Submission(sequences, lengths, layers, deadline, outputs,
                                         segments=segments),
                              request.names.sequence, response_bytes, holds)
    return await model.pack(response_bytes * COPY_BYTE_S + request.answer.seconds(shapes),
                            lambda: request.answer.respond(_dense(model, shapes, layers, results)))


def _input_shape(model: ServedModel, inputs: Sequence[InputTensor]) -> tuple[int, int]:
    """(batch, seq), from the inputs' names and declared shapes alone."""
    expected = list(model.manifest.inputs)
    names = [t.name for t in inputs[:len(expected) + 1]]
    if sorted(names) != sorted(expected):
        shown = ", ".join(quote(n) for n in names) + (" …" if len(inputs) > len(names) else "")
        raise InvalidArgument("inputs", f"got [{shown}], expected exactly {expected}")
    shape = inputs[names.index("input_ids")].shape
    for t in inputs:
        if tuple(t.shape) != tuple(shape):
            raise InvalidArgument(t.name, f"shape {list(t.shape)} differs from input_ids {list(shape)}")
    batch, seq = shape
    if seq > model.manifest.max_positions:
        raise InvalidArgument("input_ids", f"seq {seq} is longer than the model's "
                              f"{model.manifest.max_positions} positions")
    return batch, seq


def _output_names(model: ServedModel, outputs: Sequence[str]) -> tuple[list[str], tuple[int, ...]]:
    known = model.output_layers
    if len(outputs) > len(known):
        raise InvalidArgument("outputs", f"{len(outputs)} named; the model has {len(known)}, each "
                              "to be named once")
    names = list(outputs) or [next(iter(known))]
    layers: set[int] = set()
    for i, name in enumerate(names):
        if name not in known:
            listed = (LOGITS_OUTPUT if model.kind in SCORERS else
                      f"{HIDDEN_OUTPUT}, {ALL_ATTENTIONS}, attentions.0 … "
                      f"attentions.{model.manifest.num_layers - 1}")
            raise InvalidArgument(f"outputs[{i}]", f"unknown output {quote(name)}; known: {listed}")
        if name in names[:i]:
            raise InvalidArgument(f"outputs[{i}]", f"{quote(name)} is named twice")
        layers.update(known[name])
    return names, tuple(sorted(layers))


def _rows(model: ServedModel, inputs: Sequence[InputTensor], batch: int,
          seq: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray | None]:
    """Each row's ids up to its length, the lengths, and where each row's second segment
    starts (with token types)."""
    arrays = {}
    for t in inputs:
        if isinstance(t.data, bytes | bytearray | memoryview):
            array = np.frombuffer(t.data, dtype="<i8")
        else:
            # A slice at a time, letting the interpreter go between them.
            try:
                array = np.concatenate([
                    np.asarray(t.data[start:start + VALUES_SLICE], dtype=np.int64)
                    for start in range(0, len(t.data), VALUES_SLICE)])
            except OverflowError as err:
                raise InvalidArgument(t.name, "a value is outside INT64's range") from err
        arrays[t.name] = array.reshape(batch, seq).astype(np.int64, copy=False)
    ids, mask = arrays["input_ids"], arrays["attention_mask"]
    if not np.isin(mask, (0, 1)).all():
        raise InvalidArgument("attention_mask", "values must be 0 or 1")
    lengths = mask.sum(axis=1)
    ones_then_zeros = (np.arange(seq)[None, :] < lengths[:, None]).astype(mask.dtype)
    bad_rows = (lengths == 0) | (mask != ones_then_zeros).any(axis=1)
    if bad_rows.any():
        raise InvalidArgument(f"attention_mask[{int(np.argmax(bad_rows))}]",
                              "must be ones then zeros, with at least one one")
    vocab = model.manifest.vocab_size
    bad = np.argwhere((ids < 0) | (ids >= vocab))
    if bad.size:
        r, c = (int(x) for x in bad[0])
        raise InvalidArgument(f"input_ids[{r}, {c}]", f"id {int(ids[r, c])} is outside the "
                              f"vocabulary [0, {vocab})")
    segments = None if TOKEN_TYPES not in arrays else _segments(arrays[TOKEN_TYPES], lengths)
    return ([ids[row, :length] for row, length in enumerate(lengths.tolist())], lengths, segments)


def _segments(types: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Where each row's token types turn from 0 to 1 (its length for none): within a row's
    length they must be zeros then ones; past it they are padding, not read."""
    batch, seq = types.shape
    real = np.arange(seq)[None, :] < lengths[:, None]
    ones = (types == 1) & real
    starts = np.where(ones.any(axis=1), ones.argmax(axis=1), lengths)
    expected = (np.arange(seq)[None, :] >= starts[:, None]) & real
    bad = (types != expected) & real
    if bad.any():
        row, column = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidArgument(f"token_type_ids[{row}, {column}]",
                              f"{int(types[row, column])}; each row's token types must be 0 "
                              "then 1 (the query's side, then the text's) over its length")
    return starts.astype(np.int64)


def _dense(model: ServedModel, shapes: Shapes, layers: tuple[int, ...],
           results: list[SequenceResult]) -> list[tuple[str, np.ndarray]]:
    """The outputs asked for, each row zero past its sequence's length."""
    out = []
    for name, shape in shapes:
        array = np.zeros(shape, dtype="<f4")
        if name == LOGITS_OUTPUT:
            for row, r in enumerate(results):
                array[row] = r.pooled[LOGITS_OUTPUT]
        elif name == HIDDEN_OUTPUT:
            for row, r in enumerate(results):
                array[row, :len(r.hidden)] = r.hidden
        else:
            wanted = layers if name == ALL_ATTENTIONS else model.output_layers[name]
            stacked = array if name == ALL_ATTENTIONS else array[None]
            for row, r in enumerate(results):
                n = len(r.hidden)
                for k, layer in enumerate(wanted):
                    stacked[k, row, :, :n, :n] = r.attentions[layer]
        out.append((name, array))
    return out
