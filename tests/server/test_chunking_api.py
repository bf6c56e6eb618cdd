"""Chunked Embed over real loopback servers: LATE chunk vectors against Hugging Face's
BertModel run over the same windows, ISOLATED ones against it run on each chunk alone,
spans that map back to the exact substrings, errors that name their field, the OpenAI
door's extension through the `openai` client, and a 1 MB document chunked with the
queue, the memory budget and health checks intact."""

import re
import subprocess
import time

import grpc
import numpy as np
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.harness import ATTNSERVE, REPO
from tests.hugging_face import HuggingFace
from tests.server.reliability import MIB, HealthProbe, serve

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

WIDTH = 510  # MiniLM's 512 positions less [CLS] and [SEP]
ATOL = 1e-5
SEED = "服务 A 调用了配置中心 B，因为它需要获取最新配置。"
SUBJECTS = ["The old lighthouse", "A tired engineer", "The river delta", "Our small team",
            "The orchestra", "A migrating flock"]
VERBS = ["watched over", "rebuilt", "flooded", "measured", "rehearsed", "crossed"]
OBJECTS = ["the harbour at dawn", "three bridges in a week", "the fields every spring",
           "the noise of the servers", "a symphony by Dvořák", "the mountains in October"]


def english(sentences: int, seed: int = 0) -> str:
    """Plain English prose, about 11 tokens a sentence, with paragraph breaks."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(sentences):
        out.append(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}, "
                   f"and it did so {i} times.")
        out.append("\n\n" if i % 9 == 8 else " ")
    return "".join(out).strip()


def token_ranges(hf: HuggingFace, text: str, chunks) -> tuple[list[int], list[tuple[int, int]]]:
    """The text's ids (no special tokens) and each chunk's token range: the tokens that
    start inside its span."""
    encoded = hf.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]])
    ranges = [(int(np.searchsorted(starts, c.start)), int(np.searchsorted(starts, c.end)))
              for c in chunks]
    assert [last - first for first, last in ranges] == [c.num_tokens for c in chunks]
    return encoded["input_ids"], ranges


def late_reference(hf: HuggingFace, text: str, chunks, overlap: int) -> np.ndarray:
    """Each chunk's mean token embedding from Hugging Face's BertModel, run on the windows
    the API documents: WIDTH tokens, each starting WIDTH - overlap after the one before,
    the last ending with the text; a chunk pooled from the window holding it whole with
    the most context on its poorer side, then in all, then the earliest."""
    ids, ranges = token_ranges(hf, text, chunks)
    starts = [0]
    while starts[-1] + WIDTH < len(ids):
        starts.append(starts[-1] + WIDTH - overlap)
    windows = [(start, min(start + WIDTH, len(ids))) for start in starts]
    hidden = {}
    vectors = []
    for first, last in ranges:
        holding = [k for k, (a, b) in enumerate(windows) if a <= first and last <= b]
        k = max(holding, key=lambda k: (min(first - windows[k][0], windows[k][1] - last),
                                        windows[k][1] - windows[k][0] - (last - first), -k))
        a, b = windows[k]
        if k not in hidden:
            hidden[k] = hf.run([101, *ids[a:b], 102])[0]
        vectors.append(hidden[k][1 + first - a:1 + last - a].mean(axis=0))
    return np.stack(vectors)


@pytest.mark.workers
@pytest.mark.parametrize("max_tokens, overlap", [(40, 0), (40, 39)],
                         ids=["default overlap", "least overlap"])
def test_late_chunks_equal_hugging_face_over_the_same_windows(client, hf, max_tokens, overlap):
    text = english(120)
    (result,) = client.embed([text], chunk_tokens=max_tokens, window_overlap=overlap)
    assert result.num_tokens > 2 * WIDTH and result.pooled is None and not result.token_ids
    used = overlap or max_tokens - 1 + 128  # the documented default below half a window
    expected = late_reference(hf, text, result.chunks, used)
    got = np.stack([c.pooled for c in result.chunks])
    assert got.shape == expected.shape and np.abs(got - expected).max() <= ATOL
    assert len({tuple(c.pooled[:4]) for c in result.chunks}) == len(result.chunks)
    (normalized,) = client.embed([text], chunk_tokens=max_tokens, window_overlap=overlap,
                                 normalize=True)
    vectors = np.stack([c.pooled for c in normalized.chunks])
    np.testing.assert_allclose(vectors, got / np.linalg.norm(got, axis=1, keepdims=True), atol=1e-6)


@pytest.mark.workers
def test_isolated_chunks_equal_hugging_face_on_each_chunk_alone(client, hf):
    text = english(30, seed=1)
    (result,) = client.embed([text], chunk_tokens=24, isolated=True)
    assert len(result.chunks) >= 10
    for chunk in result.chunks:
        hidden, _ = hf.run(hf.ids(text[chunk.start:chunk.end]))
        assert len(hidden) == chunk.num_tokens + 2
        assert np.abs(chunk.pooled - hidden.mean(axis=0)).max() <= ATOL


@pytest.mark.parametrize("text", [
    english(25, seed=2),
    SEED + "它很快就拿到了。配置中心 B 每分钟更新一次配置，服务 A 每次调用都读取最新的一份。",
    "Service A calls the config centre B. " + SEED + " It then retries (e.g. after 3.5 s)! "
    "最后，它成功了。Done.\n\nA new paragraph, with 😀 and café."],
    ids=["English", "Chinese", "mixed"])
@pytest.mark.parametrize("isolated", [False, True], ids=["late", "isolated"])
def test_spans_map_back_to_the_exact_substrings(client, hf, text, isolated):
    (result,) = client.embed([text], chunk_tokens=12, isolated=isolated)
    ids, ranges = token_ranges(hf, text, result.chunks)
    assert result.num_tokens == len(ids) == sum(c.num_tokens for c in result.chunks)
    previous_end = 0
    for chunk, (first, last) in zip(result.chunks, ranges, strict=True):
        piece = text[chunk.start:chunk.end]
        assert piece == piece.strip() and not text[previous_end:chunk.start].strip()
        assert 1 <= chunk.num_tokens <= 12
        assert hf.tokenizer(piece, add_special_tokens=False)["input_ids"] == ids[first:last]
        previous_end = chunk.end
    assert not text[previous_end:].strip()


Chunking = pb.Chunking
LATE, ISOLATED = pb.CHUNKING_MODE_LATE, pb.CHUNKING_MODE_ISOLATED
BAD_CHUNKING = [
    (dict(chunking=Chunking()), "chunking.max_tokens", "expected 1 to 510"),
    (dict(chunking=Chunking(max_tokens=511)), "chunking.max_tokens", "511"),
    (dict(chunking=Chunking(max_tokens=8, mode=7)), "chunking.mode", "unknown value 7"),
    (dict(chunking=Chunking(max_tokens=64, window_overlap=32)), "chunking.window_overlap",
     "expected 63 (max_tokens - 1"),
    (dict(chunking=Chunking(max_tokens=8, window_overlap=510)), "chunking.window_overlap", "to 509"),
    (dict(chunking=Chunking(max_tokens=8, mode=ISOLATED, window_overlap=8)),
     "chunking.window_overlap", "leave it 0"),
    (dict(token_ids=[pb.TokenIds(ids=[101, 102])], texts=[], chunking=Chunking(max_tokens=8)),
     "chunking", "send texts"),
    (dict(chunking=Chunking(max_tokens=8), return_token_embeddings=True), "return_token_embeddings",
     "not with chunking"),
    (dict(chunking=Chunking(max_tokens=8), attention=pb.AttentionOptions()), "attention",
     "not with chunking"),
    (dict(chunking=Chunking(max_tokens=8), pooling=pb.POOLING_CLS), "pooling", "pooled by POOLING_MEAN"),
    (dict(chunking=Chunking(max_tokens=8), texts=["fine", "x" * (MIB + 1)]), "texts[1]",
     "--max-chunking-chars"),
]


@pytest.mark.parametrize("fields, field, reason", BAD_CHUNKING,
                         ids=[f"{field}:{reason}" for _, field, reason in BAD_CHUNKING])
def test_chunking_errors_name_the_field(stub, fields, field, reason):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(**{"texts": ["Some text."], **fields}))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field) and reason in err.value.details()
    (detail,) = rpc_status.from_call(err.value).details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad) and bad.field_violations[0].field == field


@pytest.mark.workers
def test_a_long_text_costs_its_windows_against_the_queue(client, hf):
    """The default queue (262,144 tokens) would take this text's tokens, but not those of
    the windows they run in (twice as many, with the default overlap)."""
    text = english(21_000)[:MIB]
    tokens = len(hf.tokenizer(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(grpc.RpcError) as err:
        client.embed([text], chunk_tokens=128)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    added = int(re.search(r"this request adds (\d+) \(limit 262144\)", err.value.details())[1])
    assert tokens < 262_144 < added and added > 1.9 * tokens
    (fits,) = client.embed([english(400)], chunk_tokens=128)
    assert fits.chunks


@pytest.mark.workers
def test_openai_client_gets_chunk_vectors_with_their_spans(minilm_server, client):
    text = english(60, seed=3)
    api = openai.OpenAI(base_url=minilm_server.http_url + "/v1", api_key="x", max_retries=0)
    for mode, isolated in (("late", False), ("isolated", True)):
        response = api.embeddings.create(
            model="all-MiniLM-L6-v2", input=["A first, short input.", text],
            extra_body={"chunking": {"max_tokens": 32, "mode": mode}})
        expected = [(i, c) for i, r in enumerate(client.embed(
            ["A first, short input.", text], chunk_tokens=32, isolated=isolated, normalize=True))
            for c in r.chunks]
        assert [d.index for d in response.data] == list(range(len(expected)))
        for item, (text_index, chunk) in zip(response.data, expected, strict=True):
            extra = item.model_extra
            assert (extra["input_index"], extra["start"], extra["end"], extra["num_tokens"]) == (
                text_index, chunk.start, chunk.end, chunk.num_tokens)
            np.testing.assert_allclose(item.embedding, chunk.pooled, atol=1e-6)
    with pytest.raises(openai.BadRequestError) as bad:
        api.embeddings.create(model="all-MiniLM-L6-v2", input="x",
                              extra_body={"chunking": {"max_tokens": "many"}})
    assert bad.value.body["param"] == "chunking.max_tokens"


def test_embed_command_prints_and_saves_chunks_with_their_spans(tiny_server, tmp_path):
    document = tmp_path / "document.txt"
    document.write_text(english(12, seed=4) + "\n")
    text = document.read_text()
    printed = subprocess.run([*ATTNSERVE, "embed", "--document", str(document), "--chunk-tokens",
                              "16", "--address", tiny_server.address],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    spans = [tuple(map(int, m)) for m in re.findall(r"^  \[(\d+):(\d+)\] \d+ tokens", printed.stdout,
                                                     re.M)]
    assert spans and spans[0][0] == 0 and spans[-1][1] == len(text.rstrip())
    out = tmp_path / "chunks.npz"
    saved = subprocess.run([*ATTNSERVE, "embed", "--document", str(document), "--chunk-tokens",
                            "16", "--isolated", "--out", str(out), "--address", tiny_server.address],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert saved.returncode == 0, saved.stderr
    arrays = np.load(out)
    assert [tuple(s) for s in arrays["spans"].tolist()] == spans
    assert arrays["vectors"].shape == (len(spans), 32) and (arrays["text_index"] == 0).all()
    assert (arrays["num_tokens"] <= 16).all()


def test_a_megabyte_document_is_chunked_in_bounded_time_and_memory(tiny_artifact):
    """1 MiB of English on the tiny model (128 positions: some 4,000 windows of 126
    tokens), in a server whose queue takes them and whose memory budget is 1 GiB: done in
    bounded time, the server's peak memory well inside the budget, health answering
    within 250 ms throughout."""
    text = english(21_000)[:MIB]
    budget = 1 << 30
    with serve(tiny_artifact, "--max-queue-tokens", str(4 << 20), "--memory-budget-bytes",
               str(budget)) as server, EncoderClient(server.address) as tiny:
        before = server.status()
        with HealthProbe(server.address, deadline_s=0.25) as probe:
            started = time.monotonic()
            (result,) = tiny.embed([text], chunk_tokens=32, timeout=120)
            seconds = time.monotonic() - started
        after = server.status()
    assert seconds < 60, f"{seconds:.1f} s"
    assert probe.ok >= 5 and not probe.failed and probe.slowest < 0.25, str(probe)
    assert after["hwm"] - before["rss"] < budget / 2, (before, after)
    assert result.num_tokens > 200_000 and sum(c.num_tokens for c in result.chunks) == result.num_tokens
    assert result.chunks[0].start == 0 and result.chunks[-1].end == len(text.rstrip())
    assert all(c.pooled.shape == (32,) for c in result.chunks)
