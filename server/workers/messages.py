"""What a front end and the engine process say to each other, as a channel's headers and
arrays (server/workers/channel.py).

front end -> engine: ["submit", job, model, layers, deadline, outputs, alone, has spans, has
segments, priority class, has attended] with the sequences' ids laid end to end, their
lengths, (late chunking) their token spans, (a reranker's pairs) where each one's second
segment starts and (ColBERT queries) how many of each one's tokens are attended to;
["cancel", job]; ["bye"] (a drained front end leaving).
engine -> front end: ["welcome", EngineFacts's fields] (the models in the order the front
ends hold them: --artifact's); ["results", job, hidden, layers, pooled names, has span
means, the job's timings (CallTimes.to_wire)] with the arrays; ["error", job, kind, message];
["cancelled", job] (a cancel was done: the job's place in the queue is free).

Requests cross as token ids (int32: a vocabulary fits), results as float32 arrays laid
end to end: one copy from the batch's outputs into the message, views on the other side."""

import dataclasses
from dataclasses import dataclass

import numpy as np

from attnserve.artifact import TOKEN_OUTPUTS, TOKEN_WEIGHTS_OUTPUT
from attnserve.server.engine.requests import Submission
from attnserve.server.engine.timings import CallTimes
from attnserve.server.errors import DeadlineExceeded, RequestError, ResourceExhausted, Unavailable
from attnserve.server.priority import Priority
from attnserve.server.runtime.backend import Placement, SequenceResult

ERRORS = {cls.__name__: cls for cls in (RequestError, ResourceExhausted, Unavailable,
                                        DeadlineExceeded)}
"""what the engine process's queue answers a request with instead of results"""


@dataclass(frozen=True)
class EngineFacts:
    """What a front end needs from the engine process before it serves."""

    budget: int
    responses_in_budget: bool
    """the ledger and the batches share one budget (the CPU), as MemoryBudget.shared"""
    models: list[Placement]
    """where each model runs, in --artifact's order"""


def submit(job: int, model: int, submission: Submission):
    ids = [s.astype(np.int32, copy=False) for s in submission.sequences]
    entries = [ids, [submission.lengths]]
    spans, segments, attended = submission.spans, submission.segments, submission.attended
    if spans is not None:  # late chunking: each sequence's [k, 2] token spans, and the ks
        entries += [spans, [np.fromiter(map(len, spans), dtype=np.int64, count=len(spans))]]
    entries += [[extra] for extra in (segments, attended) if extra is not None]
    header = ["submit", job, model, list(submission.layers), submission.deadline,
              sorted(submission.outputs), submission.alone, spans is not None,
              segments is not None, submission.priority.value, attended is not None]
    return header, entries


def _split(flat: np.ndarray, counts: np.ndarray, width: int) -> list[np.ndarray]:
    """`flat` cut into consecutive pieces of `counts` rows of `width`."""
    ends = np.cumsum(counts).tolist()
    rows = flat.reshape(-1, width)
    return [rows[end - n:end] for n, end in zip(counts.tolist(), ends, strict=True)]


def submitted(header, arrays: list[np.ndarray]) -> Submission:
    """The submission, its sequences views of the message."""
    _, _, _, layers, deadline, outputs, alone, has_spans, has_segments, priority, has_attended = header
    lengths = arrays[1].astype(np.int64)
    sequences = [s.reshape(-1) for s in _split(arrays[0], lengths, 1)]
    rest = list(arrays[4 if has_spans else 2:])
    segments = rest.pop(0).astype(np.int64) if has_segments else None
    attended = rest.pop(0).astype(np.int64) if has_attended else None
    return Submission(sequences, lengths, tuple(layers), deadline, frozenset(outputs), alone,
                      _split(arrays[2], arrays[3], 2) if has_spans else None, segments,
                      Priority(priority), attended)


def results(job: int, results: list[SequenceResult], layers: tuple[int, ...], times: CallTimes):
    hidden = results[0].hidden is not None
    means = results[0].span_means is not None
    names = sorted(results[0].pooled)
    entries = ([[r.hidden for r in results]] if hidden else []) + \
        [[r.attentions[layer] for r in results] for layer in layers] + \
        [[r.pooled[name] for r in results] for name in names]
    if means:
        entries += [[r.span_means for r in results],
                    [np.fromiter((len(r.span_means) for r in results), np.int64, len(results))]]
    return ["results", job, hidden, list(layers), names, means, times.to_wire()], entries


def received(header, arrays: list[np.ndarray], lengths: np.ndarray,
             heads: int, width: int) -> list[SequenceResult]:
    """Each sequence's result, as views of the message: `lengths` are the sequences'
    (the front end sent them), `heads` and `width` the model's."""
    hidden, layers, names, means = header[2:6]
    arrays = list(arrays)
    out_hidden = _split(arrays.pop(0), lengths, width) if hidden else [None] * len(lengths)
    cuts = np.cumsum(heads * lengths * lengths)[:-1] if layers else None  # where each map ends
    maps = [[piece.reshape(heads, n, n)
             for piece, n in zip(np.split(arrays.pop(0), cuts), lengths.tolist(), strict=True)]
            for _ in layers]
    # Pooled vectors are `width` wide, a reranker's logits one per label; a head's output
    # per token (bge-m3's) is a row a token: a vector, or a weight.
    pooled = [_per_token(name, flat, lengths) if name in TOKEN_OUTPUTS
              else flat.reshape(len(lengths), -1)
              for name, flat in ((name, arrays.pop(0)) for name in names)]
    # The means are as wide as the pooled vectors (past any Dense layers).
    span_means = (_split(arrays[0], arrays[1], arrays[0].size // int(arrays[1].sum())) if means
                  else [None] * len(lengths))
    return [SequenceResult(out_hidden[i], {layer: maps[k][i] for k, layer in enumerate(layers)},
                           {name: pooled[k][i] for k, name in enumerate(names)}, span_means[i])
            for i in range(len(lengths))]


def _per_token(name: str, flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    views = _split(flat, lengths, flat.size // int(lengths.sum()))
    return [v.reshape(-1) for v in views] if name == TOKEN_WEIGHTS_OUTPUT else views


def welcome(facts: EngineFacts):
    return ["welcome", dataclasses.asdict(facts)], []


def welcomed(header) -> EngineFacts:
    fields = dict(header[1])
    fields["models"] = [Placement(**placement) for placement in fields["models"]]
    return EngineFacts(**fields)


def error(job: int, err: RequestError):
    kind = type(err).__name__ if type(err).__name__ in ERRORS else RequestError.__name__
    return ["error", job, kind, err.message], []


def raised(header) -> RequestError:
    _, _, kind, message = header
    return ERRORS[kind](message)
