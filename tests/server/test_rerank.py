"""Promise: one server holds MiniLM and two rerankers (a BERT and an XLM-RoBERTa
cross-encoder, small and random) under one memory budget, and each door scores
(query, text) pairs as sentence-transformers' CrossEncoder.predict does, within 1e-4:
attnserve.v1 Rerank, TEI's /rerank, Cohere's and Jina's /v1/rerank (through the `cohere`
client and LangChain's CohereRerank, unchanged), KServe infer on the reranker's graph
(tritonclient), the Python client and `attnserve rerank`. Results come highest first,
top_n cut, texts back when asked; a pair over the model's positions is refused naming
its text, or with truncate has its text cut, never the query. Pairs batch together. Bad
input is refused naming the field (the model's kind, for a call the model does not serve)
and the server keeps serving."""

import json
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_status import rpc_status

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.harness import ATTNSERVE, REPO, delta
from tests.server.reliability import serve, stub
from tests.server.test_http import post_json

MINILM, BERT, XLMR = "all-MiniLM-L6-v2", "bert-reranker", "xlmr-reranker"
QUERY = "where does the cat sleep?"
TEXTS = ["Le chat dort sur le canapé pendant que la pluie tombe doucement.", "ok",
         "The quick brown fox jumps over the lazy dog.", "服务 A 调用了配置中心 B。",
         "Self-attention lets every token look at every other token.", "hello world"]
ATOL = 1e-4
# Longer than either reranker's 128 positions, with the query.
LONG = "the cat sleeps on the warm sofa while it rains " * 20


@pytest.fixture(scope="module")
def server(minilm_artifact, bert_reranker_artifact, xlmr_reranker_artifact):
    with serve(minilm_artifact, "--artifact", f"{BERT}={bert_reranker_artifact}",
               "--artifact", f"{XLMR}={xlmr_reranker_artifact}") as process:
        yield process


@pytest.fixture(scope="module")
def references(bert_reranker_checkpoint, xlmr_reranker_checkpoint):
    """sentence-transformers' CrossEncoder on each checkpoint, at its own defaults but for
    its length, set to the model's positions."""
    from sentence_transformers import CrossEncoder

    return {name: CrossEncoder(str(checkpoint), device="cpu", max_length=128)
            for name, checkpoint in ((BERT, bert_reranker_checkpoint), (XLMR, xlmr_reranker_checkpoint))}


def predicted(references, model: str, texts: list[str], raw: bool = False,
              query: str = QUERY) -> np.ndarray:
    from torch import nn

    pairs = [(query, text) for text in texts]
    if raw:
        return references[model].predict(pairs, activation_fn=nn.Identity())
    return references[model].predict(pairs)


def pair_tokens(references, model: str, texts: list[str]) -> int:
    tokenizer = references[model].tokenizer
    return sum(len(tokenizer(QUERY, text)["input_ids"]) for text in texts)


def ranked(scores: np.ndarray) -> list[int]:
    return np.argsort(-scores, kind="stable").tolist()


@pytest.mark.workers
@pytest.mark.parametrize("model", [BERT, XLMR])
def test_grpc_rerank_scores_as_sentence_transformers_and_ranks_by_them(encoder, references, model):
    want = predicted(references, model, TEXTS)
    assert want.std() > 1e-3  # the pairs score apart: the order below can be wrong
    response = encoder.Rerank(pb.RerankRequest(model=model, query=QUERY, texts=TEXTS,
                                               return_texts=True), timeout=60)
    assert response.model == model
    assert response.total_tokens == pair_tokens(references, model, TEXTS)
    got = {r.index: r.score for r in response.results}
    np.testing.assert_allclose([got[i] for i in range(len(TEXTS))], want, atol=ATOL)
    assert [r.index for r in response.results] == ranked(np.asarray([got[i] for i in range(len(TEXTS))]))
    assert [r.text for r in response.results] == [TEXTS[r.index] for r in response.results]
    raw = encoder.Rerank(pb.RerankRequest(model=model, query=QUERY, texts=TEXTS, raw_scores=True,
                                          top_n=2), timeout=60)
    assert [r.index for r in raw.results] == [r.index for r in response.results][:2]
    assert all(r.text == "" for r in raw.results)
    logits = predicted(references, model, TEXTS, raw=True)
    np.testing.assert_allclose([r.score for r in raw.results], logits[[r.index for r in raw.results]],
                               atol=ATOL)


@pytest.mark.workers
def test_one_server_holds_the_embedder_and_the_rerankers(encoder, server):
    listed = encoder.ListModels(pb.ListModelsRequest(), timeout=60)
    assert [(m.model, m.kind) for m in listed.models] == [
        (MINILM, "embedder"), (BERT, "reranker"), (XLMR, "reranker")]
    assert dict(listed.models[1].labels) == {"0": "label_0"} and not listed.models[0].labels
    # A call that names no model goes to the first of the kind it takes.
    assert encoder.Rerank(pb.RerankRequest(query=QUERY, texts=TEXTS), timeout=60).model == BERT
    assert encoder.Score(pb.ScoreRequest(query=QUERY, texts=TEXTS, mode=pb.SCORE_MODE_COSINE),
                         timeout=60).model == MINILM
    # Both kinds' batches are admitted against the memory model and the one budget.
    before = server.scrape()
    encoder.Embed(pb.EmbedRequest(texts=TEXTS), timeout=60)
    encoder.Rerank(pb.RerankRequest(model=XLMR, query=QUERY, texts=TEXTS), timeout=60)
    after = server.scrape()
    for model in (MINILM, XLMR):
        assert delta(before, after, "attnserve_batch_predicted_memory_bytes_count", model=model) >= 1


@pytest.mark.workers
def test_a_requests_pairs_run_batched(encoder, server):
    texts = [f"the cat number {i} sleeps on the sofa" for i in range(32)]
    before = server.scrape()
    encoder.Rerank(pb.RerankRequest(model=BERT, query=QUERY, texts=texts), timeout=60)
    after = server.scrape()
    assert delta(before, after, "attnserve_batch_size_sum", model=BERT) == 32
    assert delta(before, after, "attnserve_batch_size_count", model=BERT) <= 2


@pytest.mark.workers
def test_tei_rerank(server, references):
    status, body = post_json(server, "/rerank", {"query": QUERY, "texts": TEXTS, "return_text": True})
    assert status == 200
    want = predicted(references, BERT, TEXTS)  # no model named: the first reranker
    assert sorted(r["index"] for r in body) == list(range(len(TEXTS)))
    np.testing.assert_allclose([r["score"] for r in body], want[[r["index"] for r in body]], atol=ATOL)
    assert [r["score"] for r in body] == sorted((r["score"] for r in body), reverse=True)
    assert all(r["text"] == TEXTS[r["index"]] for r in body)
    status, raw = post_json(server, "/rerank", {"query": QUERY, "texts": TEXTS, "raw_scores": True,
                                           "model": XLMR})
    assert status == 200 and all("text" not in r for r in raw)
    np.testing.assert_allclose([r["score"] for r in raw],
                               predicted(references, XLMR, TEXTS, raw=True)[[r["index"] for r in raw]],
                               atol=ATOL)


def test_cohere_client_and_jinas_shape(server, references):
    import cohere

    client = cohere.Client(api_key="unused", base_url=server.http_url)
    response = client.rerank(model=XLMR, query=QUERY, documents=TEXTS, top_n=3,
                             return_documents=True)
    want = predicted(references, XLMR, TEXTS)
    assert [r.index for r in response.results] == ranked(want)[:3]
    np.testing.assert_allclose([r.relevance_score for r in response.results],
                               want[ranked(want)[:3]], atol=ATOL)
    assert [r.document.text for r in response.results] == [TEXTS[i] for i in ranked(want)[:3]]
    # Jina's: documents as objects, the model and usage in the answer.
    status, body = post_json(server, "/v1/rerank", {"model": BERT, "query": QUERY,
                                               "documents": [{"text": t} for t in TEXTS],
                                               "return_documents": True})
    assert status == 200 and body["model"] == BERT and len(body["id"]) == 36
    assert body["usage"] == {"total_tokens": pair_tokens(references, BERT, TEXTS)}
    assert [r["document"]["text"] for r in body["results"]] == [TEXTS[r["index"]] for r in body["results"]]
    np.testing.assert_allclose([r["relevance_score"] for r in body["results"]],
                               predicted(references, BERT, TEXTS)[[r["index"] for r in body["results"]]],
                               atol=ATOL)


def test_langchains_cohere_rerank(server, references):
    from langchain_cohere import CohereRerank
    from langchain_core.documents import Document

    reranker = CohereRerank(model=BERT, base_url=server.http_url, cohere_api_key="unused", top_n=3)
    kept = reranker.compress_documents([Document(page_content=t) for t in TEXTS], QUERY)
    want = predicted(references, BERT, TEXTS)
    assert [d.page_content for d in kept] == [TEXTS[i] for i in ranked(want)[:3]]
    np.testing.assert_allclose([d.metadata["relevance_score"] for d in kept],
                               want[ranked(want)[:3]], atol=ATOL)


TRITON = """
import json, sys
import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

address, http_address, model, feed = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
found = {}
for kind, module, client in (("grpc", tgrpc, tgrpc.InferenceServerClient(address)),
                             ("http", thttp, thttp.InferenceServerClient(http_address))):
    meta = client.get_model_metadata(model)
    meta = meta if kind == "http" else {"inputs": [{"name": i.name} for i in meta.inputs],
                                        "outputs": [{"name": o.name, "shape": list(o.shape)}
                                                    for o in meta.outputs]}
    found[kind + "_inputs"] = [i["name"] for i in meta["inputs"]]
    found[kind + "_outputs"] = [(o["name"], list(o["shape"])) for o in meta["outputs"]]
    inputs = []
    for name in found[kind + "_inputs"]:
        array = np.asarray(feed[name], dtype=np.int64)
        inputs.append(module.InferInput(name, list(array.shape), "INT64"))
        inputs[-1].set_data_from_numpy(array)
    result = client.infer(model, inputs, outputs=[module.InferRequestedOutput("logits")])
    found[kind + "_logits"] = result.as_numpy("logits").tolist()
print(json.dumps(found))
"""


@pytest.mark.workers
@pytest.mark.parametrize("model", [BERT, XLMR])
def test_kserve_infer_on_the_rerankers_graph(server, references, model):
    tokenizer = references[model].tokenizer
    batch = tokenizer([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="np")
    feed = {name: value.tolist() for name, value in batch.items()}
    done = subprocess.run([sys.executable, "-c", TRITON, server.address,
                           f"127.0.0.1:{server.http_port}", model, json.dumps(feed)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if model == BERT else [])
    for kind in ("grpc", "http"):
        assert found[kind + "_inputs"] == inputs
        assert found[kind + "_outputs"] == [("logits", [-1, 1])] or \
            found[kind + "_outputs"] == [["logits", [-1, 1]]]
        np.testing.assert_allclose(np.asarray(found[kind + "_logits"])[:, 0],
                                   predicted(references, model, TEXTS, raw=True), atol=ATOL)


def invalid(call) -> tuple[str, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    status = rpc_status.from_call(err.value)
    from google.rpc import error_details_pb2

    detail = error_details_pb2.BadRequest()
    status.details[0].Unpack(detail)
    return detail.field_violations[0].field, err.value.details()


@pytest.mark.parametrize("model", [BERT, XLMR])
def test_a_long_pair_is_refused_or_has_its_text_cut(encoder, references, model):
    texts = ["ok", LONG]
    field, message = invalid(lambda: encoder.Rerank(pb.RerankRequest(model=model, query=QUERY,
                                                                     texts=texts), timeout=60))
    assert field == "texts[1]" and "longer than the model's 128 positions" in message
    response = encoder.Rerank(pb.RerankRequest(model=model, query=QUERY, texts=texts,
                                               truncate=True), timeout=60)
    got = {r.index: r.score for r in response.results}
    # sentence-transformers cuts the longer side first: with a short query, the text alone.
    np.testing.assert_allclose([got[0], got[1]], predicted(references, model, texts), atol=ATOL)
    assert response.total_tokens == len(references[model].tokenizer(QUERY, "ok")["input_ids"]) + 128
    field, message = invalid(lambda: encoder.Rerank(pb.RerankRequest(
        model=model, query=LONG, texts=["ok"], truncate=True), timeout=60))
    assert field == "query" and "leaving no room for a text" in message


@pytest.mark.parametrize("model", [BERT, XLMR])
def test_tei_rerank_cuts_a_long_text_at_the_side_asked(server, references, model):
    """TEI's truncation_direction: with truncate, a pair over the model's positions keeps its
    text's start (Right, the default) or its end (Left), never cutting the query, as
    sentence-transformers scores it with its tokenizer cutting at that side."""
    text = "Stock markets fell sharply on Monday. " * 20 + LONG  # markets first, cats last
    tokenizer, scores = references[model].tokenizer, {}
    for side in ("Right", "Left"):
        status, ranks = post_json(server, "/rerank", {
            "model": model, "query": QUERY, "texts": ["ok", text], "truncate": True,
            "truncation_direction": side, "raw_scores": True})
        tokenizer.truncation_side = side.lower()
        try:
            want = predicted(references, model, ["ok", text], raw=True)
        finally:
            tokenizer.truncation_side = "right"
        scores[side] = {r["index"]: r["score"] for r in ranks}
        assert status == 200
        np.testing.assert_allclose([scores[side][0], scores[side][1]], want, atol=ATOL)
    assert abs(scores["Left"][1] - scores["Right"][1]) > 10 * ATOL


BAD_GRPC = [
    (lambda e: e.Rerank(pb.RerankRequest(model=BERT, query=QUERY)), "texts", "empty"),
    (lambda e: e.Rerank(pb.RerankRequest(model=BERT, texts=TEXTS)), "query", "empty"),
    (lambda e: e.Rerank(pb.RerankRequest(model=BERT, query=QUERY, texts=TEXTS, top_n=0)), "top_n",
     "0; expected 1 or more"),
    (lambda e: e.Rerank(pb.RerankRequest(model=BERT, query=QUERY, texts=TEXTS, top_n=-2)), "top_n",
     "-2; expected 1 or more"),
    (lambda e: e.Rerank(pb.RerankRequest(model=MINILM, query=QUERY, texts=TEXTS)), "model",
     f"'{MINILM}' is an embedding model"),
    (lambda e: e.Embed(pb.EmbedRequest(model=BERT, texts=TEXTS)), "model",
     f"'{BERT}' is a reranker"),
    (lambda e: e.Score(pb.ScoreRequest(model=XLMR, query=QUERY, texts=TEXTS,
                                       mode=pb.SCORE_MODE_MAXSIM)), "model", f"'{XLMR}' is a reranker"),
]


@pytest.mark.parametrize("call, field, reason", BAD_GRPC)
def test_bad_grpc_input_names_the_field(encoder, call, field, reason):
    got, message = invalid(lambda: call(encoder))
    assert got == field and reason in message, message
    assert encoder.Rerank(pb.RerankRequest(model=BERT, query=QUERY, texts=TEXTS), timeout=60).results


BAD_HTTP = [
    ("/rerank", {"query": QUERY, "texts": []}, "texts: empty", "error"),
    ("/rerank", {"texts": TEXTS}, "query: required", "error"),
    ("/rerank", {"query": QUERY, "texts": ["a", 3]}, "texts[1]: expected a string, got an integer",
     "error"),
    ("/rerank", {"query": QUERY, "texts": TEXTS, "model": MINILM}, "is an embedding model", "error"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 0}, "top_n: 0; expected 1", "message"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": -1}, "top_n: -1", "message"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": "3"}, "top_n: expected an "
     "integer or null, got a string", "message"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_n": 2.5}, "top_n: expected an "
     "integer or null, got a number", "message"),
    ("/v1/rerank", {"query": "", "documents": TEXTS}, "query: empty", "message"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"title": "x"}]}, "documents[0].text: required",
     "message"),
    ("/v1/rerank", {"query": QUERY, "documents": TEXTS, "top_k": 3}, "top_k: unknown field; known: "
     "query, documents", "message"),
    ("/v2/rerank", {"query": QUERY, "documents": TEXTS, "model": MINILM}, "is an embedding model",
     "message"),
]


@pytest.mark.parametrize("path, body, reason, key", BAD_HTTP)
def test_bad_http_input_is_refused_in_the_routes_shape(server, path, body, reason, key):
    """Cohere's routes answer 400; TEI's, as TEI does, 422 for a request it cannot take."""
    status, answer = post_json(server, path, body)
    assert status == (422 if key == "error" else 400) and reason in answer[key], answer
    if key == "error":
        assert answer["error_type"] == "Validation"
    texts = "documents" if key == "message" else "texts"
    assert post_json(server, path, {"query": QUERY, texts: TEXTS})[0] == 200


@pytest.fixture(scope="module")
def reranker_first(bert_reranker_artifact, tmp_path_factory):
    """A server whose default model is a reranker, with a small queue, beside a classifier
    of three labels."""
    from tests.conftest import export
    from tests.families import make_reranker

    root = tmp_path_factory.mktemp("three")
    three = export(root / "three", make_reranker("xlm-roberta", root / "ck", num_labels=3),
                   "--kind", "reranker")
    with serve(bert_reranker_artifact, "--max-queue-tokens", "64",
               "--artifact", f"three={three}") as capped:
        yield capped


def test_the_cheap_limits_are_embeds_and_several_labels_are_infers(reranker_first):
    """Texts past what the queue holds are refused before any is tokenized, as Embed's; a
    classifier of several labels has no one score to rank by: Rerank refuses it, naming its
    labels, and KServe infer returns its logits."""
    from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
    from tests.server.reliability import infer_request

    with grpc.insecure_channel(reranker_first.address) as channel:
        encoder = stub(channel)
        with pytest.raises(grpc.RpcError) as err:
            encoder.Rerank(pb.RerankRequest(query=QUERY, texts=["a"] * 20), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "this request adds at least" in err.value.details()
        field, message = invalid(lambda: encoder.Rerank(pb.RerankRequest(
            model="three", query=QUERY, texts=TEXTS), timeout=60))
        assert field == "model" and "'three' has 3 labels ('label_0', 'label_1', 'label_2')" in message
        inferred = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            infer_request("three", [[0, 17, 23, 2], [0, 9, 2]]), timeout=60)
        assert [(o.name, list(o.shape)) for o in inferred.outputs] == [("logits", [2, 3])]
    status, body = post_json(reranker_first, "/v1/rerank", {"query": QUERY, "documents": ["a"] * 20})
    assert status == 429 and "queue full" in body["message"]


def test_teis_root_and_info_follow_a_reranker(reranker_first, references):
    """TEI routes its root by the model's kind: a reranker's is /rerank; /info says
    reranker, with its labels."""
    texts = TEXTS[:2]
    status, root = post_json(reranker_first, "/", {"query": QUERY, "texts": texts})
    assert status == 200, root
    assert root == post_json(reranker_first, "/rerank", {"query": QUERY, "texts": texts})[1]
    np.testing.assert_allclose([r["score"] for r in sorted(root, key=lambda r: r["index"])],
                               predicted(references, BERT, texts), atol=ATOL)
    status, error = post_json(reranker_first, "/", {"inputs": "a"})
    assert (status, error["error_type"]) == (422, "Validation") and "query" in error["error"]
    with urllib.request.urlopen(reranker_first.http_url + "/info", timeout=60) as answer:
        info = json.loads(answer.read())
    assert info["model_type"] == {"reranker": {"id2label": {"0": "label_0"},
                                               "label2id": {"label_0": 0}}}


def test_the_python_client_and_the_cli(server, references):
    want = predicted(references, XLMR, TEXTS)
    with EncoderClient(server.address) as client:
        results = client.rerank(QUERY, TEXTS, top_n=3, model=XLMR, return_texts=True)
    assert [r.index for r in results] == ranked(want)[:3]
    np.testing.assert_allclose([r.score for r in results], want[ranked(want)[:3]], atol=ATOL)
    assert [r.text for r in results] == [TEXTS[i] for i in ranked(want)[:3]]
    out = subprocess.run([*ATTNSERVE, "rerank", "--address", server.address, "--model", XLMR,
                          "--top-n", "2", QUERY, *TEXTS], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    for line, index in zip(lines, ranked(want)[:2], strict=True):
        # "  1. +0.435953  [0] 'Le chat …'": the score compared as a number, not as digits
        # (a score of 0.43596 against 0.435953 differs in its fourth decimal)
        assert f"[{index}] {TEXTS[index][:60]!r}" in line, line
        assert abs(float(line.split()[1]) - want[index]) <= ATOL, (line, want[index])


@pytest.mark.parametrize("path, key", [("/rerank", "error_type"), ("/similarity", "error_type"),
                                       ("/v1/rerank", "message"), ("/v2/rerank", "message")])
def test_a_wrong_method_is_answered_in_the_routes_shape(server, path, key):
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.http_url + path, timeout=60)
    assert err.value.code == 405 and err.value.headers["Allow"] == "POST"
    assert key in json.loads(err.value.read())
