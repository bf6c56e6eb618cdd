"""The front end's and the engine process's channel (server/workers/channel.py) and what
they say over it (messages.py), over a real SOCK_SEQPACKET socket pair in this process:
small messages inline, large ones through a memfd as views, every message whole and in
order, a closed peer told once; and every message of the protocol read back as it was
written (sequences, spans, results of every output kind, errors, the engine's facts)."""

import asyncio
import socket

import numpy as np
import pytest

from attnserve.server.engine.requests import Submission
from attnserve.server.engine.timings import CallTimes
from attnserve.server.errors import DeadlineExceeded, RequestError, ResourceExhausted
from attnserve.server.priority import Priority
from attnserve.server.runtime.backend import Placement, SequenceResult
from attnserve.server.workers import messages
from attnserve.server.workers.channel import INLINE_BYTES, Channel, decode, encode

WAIT_S = 30


async def exchange(sent: list[tuple[object, list]]) -> tuple[list, int]:
    """Each (header, entries) sent from one end, what the other received, and how many
    times the sender was told its peer closed (once the receiver closes)."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    got, closed, done = [], [], asyncio.Event()

    def received(header, arrays):
        got.append((header, [np.array(a) for a in arrays]))
        if len(got) == len(sent):
            done.set()

    sender = Channel(left, lambda *_: None, lambda: closed.append(1))
    receiver = Channel(right, received, lambda: None)
    for header, entries in sent:
        sender.send(header, entries)
    await asyncio.wait_for(done.wait(), WAIT_S)
    receiver.close()
    for _ in range(WAIT_S * 100):
        if closed:
            break
        await asyncio.sleep(0.01)
    sender.close()
    return got, len(closed)


def test_small_and_large_messages_arrive_whole_and_in_order():
    rng = np.random.default_rng(0)
    small = [rng.standard_normal(16).astype(np.float32)]
    large = [rng.standard_normal(INLINE_BYTES).astype(np.float32),  # 4 × INLINE_BYTES bytes
             rng.integers(0, 1 << 30, 1000).astype(np.int64)]
    sent = [(["small", 1], [[small[0]]]), (["large", 2], [[large[0][:1000], large[0][1000:]],
                                                          [large[1]]]),
            (["empty", 3], [])]
    got, closed = asyncio.run(exchange(sent))
    assert [h for h, _ in got] == [["small", 1], ["large", 2], ["empty", 3]]
    np.testing.assert_array_equal(got[0][1][0], small[0])
    np.testing.assert_array_equal(got[1][1][0], large[0])  # two parts laid end to end
    np.testing.assert_array_equal(got[1][1][1], large[1])
    assert got[1][1][1].dtype == np.int64 and got[2][1] == []
    assert closed == 1


def test_a_large_message_travels_as_a_memfd_and_is_read_as_views_of_it():
    big = np.arange(INLINE_BYTES, dtype=np.float32)
    datagram, fd = encode(["x"], [[big]])
    assert fd is not None and len(datagram) < INLINE_BYTES
    small_datagram, no_fd = encode(["y"], [[big[:8]]])
    assert no_fd is None
    header, arrays = decode(small_datagram)
    assert header == ["y"] and arrays[0].tolist() == big[:8].tolist()


def result(n: int, hidden: int, heads: int, layers: tuple[int, ...], pooled: list[str],
           spans: int | None, rng) -> SequenceResult:
    return SequenceResult(
        rng.standard_normal((n, hidden)).astype(np.float32),
        {layer: rng.random((heads, n, n)).astype(np.float32) for layer in layers},
        {name: rng.standard_normal(1 if name == "logits" else hidden).astype(np.float32)
         for name in pooled},
        None if spans is None else rng.standard_normal((spans, hidden)).astype(np.float32))


@pytest.mark.parametrize("layers,pooled,spans,segmented", [
    ((), ["pooled_mean"], None, False), ((0, 2), [], None, False),
    ((), ["pooled_cls", "pooled_mean_normalized"], 3, False),
    ((), ["logits"], None, True)])  # a reranker's pairs: their segments, one logit each
def test_every_message_reads_back_as_it_was_written(layers, pooled, spans, segmented):
    rng = np.random.default_rng(1)
    hidden, heads = 8, 2
    lengths = np.array([3, 1, 5], dtype=np.int64)
    sequences = [rng.integers(0, 30000, n).astype(np.int64) for n in lengths]
    token_spans = None if spans is None else [np.array([[0, 1], [1, n]]) for n in lengths]
    segments = np.array([2, 1, 3], dtype=np.int64) if segmented else None
    # A ColBERT query's expansion tokens run unattended: with and without, beside the rest.
    attended = np.array([2, 1, 5], dtype=np.int64) if segmented else None
    header, entries = messages.submit(7, 2, Submission(
        sequences, lengths, (1,), 12.5, frozenset({"last_hidden_state"}), 3.0, token_spans,
        segments, Priority.BULK, attended))
    (got_header, arrays), = asyncio.run(exchange([(header, entries)]))[0]
    assert got_header[:7] == ["submit", 7, 2, [1], 12.5, ["last_hidden_state"], 3.0]
    back = messages.submitted(got_header, arrays)
    assert back.lengths.tolist() == lengths.tolist()
    assert (back.layers, back.deadline, back.outputs, back.alone, back.priority) == (
        (1,), 12.5, frozenset({"last_hidden_state"}), 3.0, Priority.BULK)
    assert (None if back.segments is None else back.segments.tolist()) == (
        None if segments is None else segments.tolist())
    assert (None if back.attended is None else back.attended.tolist()) == (
        None if attended is None else attended.tolist())
    assert [s.tolist() for s in back.sequences] == [s.tolist() for s in sequences]
    assert (back.spans is None) == (token_spans is None)
    if token_spans is not None:
        assert [s.tolist() for s in back.spans] == [s.tolist() for s in token_spans]

    results = [result(int(n), hidden, heads, layers, pooled, spans, rng) for n in lengths]
    times = CallTimes(compute_tokens=9)
    times.add("queue", 1.0, 1.25)
    times.add("inference", 1.25, 2.0, counted=False, batch_size=3, padded_shape=[4, 5])
    header, entries = messages.results(7, results, layers, times)
    (got_header, arrays), = asyncio.run(exchange([(header, entries)]))[0]
    # The job's timings cross with it, for the front end's headers and spans.
    crossed = CallTimes()
    crossed.add_wire(got_header[6])
    assert crossed.seconds == times.seconds and crossed.compute_tokens == 9
    assert crossed.spans == times.spans
    for want, back in zip(results, messages.received(got_header, arrays, lengths, heads, hidden),
                          strict=True):
        np.testing.assert_array_equal(back.hidden, want.hidden)
        assert sorted(back.attentions) == sorted(want.attentions)
        for layer in layers:
            np.testing.assert_array_equal(back.attentions[layer], want.attentions[layer])
        assert sorted(back.pooled) == sorted(want.pooled)
        for name in pooled:
            np.testing.assert_array_equal(back.pooled[name], want.pooled[name])
        if spans is None:
            assert back.span_means is None
        else:
            np.testing.assert_array_equal(back.span_means, want.span_means)


def test_errors_and_the_engines_facts_read_back():
    for err in (ResourceExhausted("queue full"), DeadlineExceeded("late"), RequestError("boom")):
        header, _ = messages.error(3, err)
        back = messages.raised(header)
        assert type(back) is type(err) and back.message == err.message
    facts = messages.EngineFacts(1 << 30, True, [
        Placement("CPUExecutionProvider", "fp32", "cpu", "--device cpu", "onnxruntime_onnx"),
        Placement("CPUExecutionProvider", "int8", "cpu", "--device cpu", "onnxruntime_onnx")])
    header, entries = messages.welcome(facts)
    (got_header, _), = asyncio.run(exchange([(header, entries)]))[0]
    assert messages.welcomed(got_header) == facts
