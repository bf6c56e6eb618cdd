"""MPNet, DistilBERT, Qwen3 and Gemma3 served by a real `attnserve serve`, each family's
sentence-transformers checkpoint (tests/families.py's SENTENCE_MODULES: its pooling, Dense
layers, Normalize and prompts) and, where transformers has one, its sequence classifier,
exported once for the session (conftest's sentence_artifact and classifier_artifact), one
server a family holding both:

- the vectors of gRPC Embed, OpenAI's /v1/embeddings, Infinity's /embeddings and TEI's
  /embed, with and without each prompt, within cosine 0.99999 of
  SentenceTransformer.encode, Qwen3's last token and Gemma3's Dense layers and window (a
  text past it) among them;
- KServe's infer over HTTP and gRPC: the hidden states of a padded batch of ids within
  1e-4 of transformers' model of the family;
- a text cut on either side: the checkpoint's tokens (its closing special token kept) and
  SentenceTransformer.encode's vector of them;
- late chunks (each chunk's mean token state through sentence-transformers' own Dense
  modules) and isolated ones (SentenceTransformer.encode of each chunk: Qwen3's last
  token, not a mean);
- Tokenize over gRPC and TEI, with a prompt: the checkpoint tokenizer's ids;
- the rerankers over gRPC, Cohere's /v1/rerank and TEI's /rerank against
  sentence-transformers' CrossEncoder.

The vectors, the hidden states and the rerankers' scores are also checked against servers
of two front-end processes (the `workers` mark), which carry them from the engine process."""

import dataclasses
import json
import urllib.request

import numpy as np
import pytest
import torch

from attnserve.client import EncoderClient

# The export's tests' texts (one past Gemma3's window) and measure.
from tests.export.test_sentence_families import MIN_COSINE, TEXTS, cosines
from tests.families import CLASSIFIER_FAMILIES, GEMMA3_WINDOW, SENTENCE_FAMILIES
from tests.harness import ServerProcess
from tests.hugging_face import HuggingFace
from tests.server.test_http import post_json

RERANK_ATOL = 1e-4
# Past every tiny model's 128 positions.
LONG = "Le chat dort sur le canapé pendant que la pluie tombe doucement. " * 12
# Within one window of every tiny model: its late chunks are pooled from the text run whole.
CHUNKED = ("The quick brown fox jumps over the lazy dog. Self-attention lets every token "
           "look at every other token. Hello world, don't panic!")
QUERY = "where does the cat sleep?"
DOORS = ("grpc", "openai", "infinity", "tei")
HIDDEN_ATOL = 1e-4


@pytest.fixture(scope="module", params=SENTENCE_FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def exported(family, sentence_artifact):
    return sentence_artifact(family)


@pytest.fixture(scope="module")
def server(family, exported, classifier_artifact):
    """The family's embedder (the default model, which TEI's embedding routes serve) and
    its reranker."""
    flags = []
    if family in CLASSIFIER_FAMILIES:
        flags = ["--artifact", f"reranker={classifier_artifact(family)[1].directory}"]
    with ServerProcess(f"{family}={exported[1].directory}", *flags) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with EncoderClient(server.address) as c:
        yield c


@pytest.fixture(scope="module")
def st(exported):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(exported[0]), device="cpu")
    model.max_seq_length = exported[1].manifest.max_positions
    return model


def vectors(door: str, server, client, family: str, texts: list[str], prompt: str | None):
    """Each text's vector from `door`, normalised (OpenAI's and TEI's are)."""
    if door == "grpc":
        return np.stack([r.pooled for r in client.embed(texts, model=family, normalize=True,
                                                        prompt_name=prompt or "")])
    named = {"prompt_name": prompt} if prompt else {}
    if door in ("openai", "infinity"):
        path = "/v1/embeddings" if door == "openai" else "/embeddings"
        status, answer = post_json(server, path, {"model": family, "input": texts, **named})
        assert status == 200, answer
        return np.array([item["embedding"] for item in answer["data"]])
    status, answer = post_json(server, "/embed", {"inputs": texts, **named})
    assert status == 200, answer
    return np.array(answer)


@pytest.mark.workers
@pytest.mark.parametrize("door", DOORS)
def test_vectors_equal_sentence_transformers(door, server, client, family, st, exported):
    prompts = [None, *(name for name, text in exported[1].manifest.prompts.items() if text)]
    for prompt in prompts:
        want = st.encode(TEXTS, prompt_name=prompt, normalize_embeddings=True)
        got = vectors(door, server, client, family, TEXTS, prompt)
        assert got.shape == want.shape
        assert cosines(got, want).min() >= MIN_COSINE, (door, prompt)


@pytest.mark.workers
@pytest.mark.parametrize("door", ["http", "grpc"])
def test_kserve_infer_gives_transformers_hidden_states(door, server, family, exported):
    """A batch of two sequences of ids, the shorter padded on the right: each one's real
    positions as transformers' model of the family (Qwen3's causal attention, Gemma3's
    windows) computes them alone."""
    hf = HuggingFace(exported[0])
    sequences = [hf.ids(TEXTS[2]), hf.ids(TEXTS[0])]
    longest = max(map(len, sequences))
    mask = np.array([[1] * len(s) + [0] * (longest - len(s)) for s in sequences])
    ids = np.array([s + [exported[1].manifest.pad_token_id] * (longest - len(s))
                    for s in sequences])
    if door == "http":
        status, answer = post_json(server, f"/v2/models/{family}/infer", {
            "inputs": [{"name": name, "shape": list(array.shape), "datatype": "INT64",
                        "data": array.ravel().tolist()}
                       for name, array in (("input_ids", ids), ("attention_mask", mask))],
            "outputs": [{"name": "last_hidden_state"}]})
        assert status == 200, answer
        (output,) = answer["outputs"]
        hidden = np.array(output["data"], dtype=np.float32).reshape(output["shape"])
    else:
        hidden = kserve_grpc_hidden(server, family, ids, mask)
    for row, sequence in enumerate(sequences):
        want, _ = hf.run(sequence)
        assert np.abs(hidden[row, :len(sequence)] - want).max() <= HIDDEN_ATOL, (door, row)


def kserve_grpc_hidden(server, model: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import grpc

    from attnserve.server._proto.inference import grpc_service_pb2 as kpb
    from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc

    request = kpb.ModelInferRequest(model_name=model)
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        request.inputs.add(name=name, datatype="INT64", shape=array.shape)
        request.raw_input_contents.append(array.astype("<i8").tobytes())
    request.outputs.add(name="last_hidden_state")
    with grpc.insecure_channel(server.address) as channel:
        response = kpb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    (output,) = response.outputs
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(tuple(output.shape))


def test_model_info_gives_the_vectors_size(client, family, exported):
    info = client.model_info(model=family)
    assert (info.embedding_size, info.hidden_size) == (exported[1].manifest.embedding_size, 32)
    assert info.default_pooling == {"mean": 1, "cls": 2, "lasttoken": 4}[
        exported[1].manifest.default_pooling]


def test_teis_info_names_the_pooling_as_tei_does(server, exported):
    with urllib.request.urlopen(server.http_url + "/info", timeout=30) as response:
        info = json.loads(response.read())
    pooling = exported[1].manifest.default_pooling
    assert info["model_type"] == {"embedding": {"pooling": {"lasttoken": "last_token"}.get(
        pooling, pooling)}}


def test_unnormalised_vectors_are_sentence_transformers_own(client, family, st, exported):
    """Without `normalize`, a model whose modules do not end in Normalize (DistilBERT's:
    a Tanh Dense layer) returns its vectors at their own length."""
    got = np.stack([r.pooled for r in client.embed(TEXTS, model=family)])
    want = st.encode(TEXTS)
    assert cosines(got, want).min() >= MIN_COSINE
    if not exported[1].manifest.normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1),
                                   rtol=1e-4)


def test_a_text_crosses_gemma3s_window(sentence_artifact):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(sentence_artifact("gemma3_text")[0]))
    assert max(len(tokenizer(text)["input_ids"]) for text in TEXTS) > GEMMA3_WINDOW + 1


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_cut_text_keeps_the_checkpoints_special_tokens(client, family, st, exported, side):
    positions = exported[1].manifest.max_positions
    tokenizer = st.tokenizer
    whole = tokenizer(LONG)["input_ids"]
    assert len(whole) > positions
    (result,) = client.embed([LONG], model=family, truncate=True, truncation_direction=side,
                             normalize=True)
    tokenizer.truncation_side = side  # transformers' tokenizers take it as a setting only
    try:
        want_ids = tokenizer(LONG, truncation=True, max_length=positions)["input_ids"]
        want = st.encode([LONG], normalize_embeddings=True)
    finally:
        tokenizer.truncation_side = "right"
    assert want_ids[-1] == whole[-1]  # the closing special token, kept
    assert result.token_ids == want_ids
    assert cosines(result.pooled[None], want).min() >= MIN_COSINE


def head_tokens(tokenizer, text: str) -> int:
    """How many special tokens the checkpoint's tokenizer puts before a text (none for
    Qwen3's, which appends its one)."""
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    full = tokenizer(text)["input_ids"]
    return next(k for k in range(len(full)) if full[k:k + len(plain)] == plain)


def after_pooling(st, pooled: np.ndarray) -> np.ndarray:
    """sentence-transformers' own modules after its Pooling (Dense layers, Normalize) on
    vectors pooled elsewhere."""
    from sentence_transformers.sentence_transformer.modules import Pooling

    features = {"sentence_embedding": torch.from_numpy(pooled)}
    start = next(i for i, module in enumerate(st) if isinstance(module, Pooling)) + 1
    with torch.no_grad():
        for module in list(st)[start:]:
            features = module(features)
    return features["sentence_embedding"].numpy()


def test_late_chunks_are_means_through_the_dense_layers(client, family, st):
    (result,) = client.embed([CHUNKED], model=family, chunk_tokens=8, normalize=True)
    counts = [c.num_tokens for c in result.chunks]
    tokens = st.encode([CHUNKED], output_value="token_embeddings")[0].numpy()
    head = head_tokens(st.tokenizer, CHUNKED)
    assert len(counts) > 2
    assert sum(counts) == len(st.tokenizer(CHUNKED, add_special_tokens=False)["input_ids"])
    bounds = head + np.concatenate([[0], np.cumsum(counts)])
    means = np.stack([tokens[a:b].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    want = after_pooling(st, means.astype(np.float32))
    got = np.stack([c.pooled for c in result.chunks])
    assert cosines(got, want).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def test_isolated_chunks_are_pooled_as_the_model_pools_a_text(client, family, st):
    """Each chunk's tokens (the whole text's, cut: a byte-level token keeps the space
    before its word) between the checkpoint's special tokens, run alone through
    sentence-transformers' modules."""
    (result,) = client.embed([CHUNKED], model=family, chunk_tokens=8, isolated=True,
                             normalize=True)
    counts = [c.num_tokens for c in result.chunks]
    assert len(counts) > 2
    plain = st.tokenizer(CHUNKED, add_special_tokens=False)["input_ids"]
    empty = st.tokenizer("")["input_ids"]
    head, tail = empty[:head_tokens(st.tokenizer, CHUNKED)], empty[head_tokens(st.tokenizer, CHUNKED):]
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    want = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        ids = torch.tensor([head + plain[a:b] + tail])
        with torch.no_grad():
            want.append(st({"input_ids": ids, "attention_mask": torch.ones_like(ids)})[
                "sentence_embedding"][0].numpy())
    assert cosines(np.stack([c.pooled for c in result.chunks]), np.stack(want)).min() >= MIN_COSINE


def test_tokenize_gives_the_checkpoints_tokens(server, client, family, st, exported):
    tokenizer = st.tokenizer
    prompts = exported[1].manifest.prompts
    prompt = next((name for name, text in prompts.items() if text), None)
    for name in [None, prompt] if prompt else [None]:
        lead = prompts[name] if name else ""
        want = [tokenizer(lead + text)["input_ids"] for text in TEXTS]
        assert [list(t.ids) for t in client.tokenize(TEXTS, model=family,
                                                     prompt_name=name or "")] == want
        status, answer = post_json(server, "/tokenize", {"inputs": TEXTS, **(
            {"prompt_name": name} if name else {})})
        assert status == 200, answer
        assert [[token["id"] for token in tokens] for tokens in answer] == want


# --- rerankers ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder(family, classifier_artifact, exported):
    if family not in CLASSIFIER_FAMILIES:
        pytest.skip(f"transformers has no sequence classifier of {family}")
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(classifier_artifact(family)[0]), device="cpu",
                        max_length=exported[1].manifest.max_positions)


@pytest.mark.workers
def test_rerankers_score_as_the_cross_encoder_on_every_door(server, client, cross_encoder):
    logits = cross_encoder.predict([(QUERY, text) for text in TEXTS],
                                   activation_fn=torch.nn.Identity())
    assert logits.std() > 1e-3  # the pairs score apart
    raw = {r.index: r.score for r in client.rerank(QUERY, TEXTS, raw_scores=True)}
    np.testing.assert_allclose([raw[i] for i in range(len(TEXTS))], logits, atol=RERANK_ATOL)
    relevance = 1 / (1 + np.exp(-logits))
    status, answer = post_json(server, "/v1/rerank", {"model": "reranker", "query": QUERY,
                                                      "documents": TEXTS})
    assert status == 200, answer
    cohere = {r["index"]: r["relevance_score"] for r in answer["results"]}
    np.testing.assert_allclose([cohere[i] for i in range(len(TEXTS))], relevance, atol=RERANK_ATOL)
    status, answer = post_json(server, "/rerank", {"query": QUERY, "texts": TEXTS,
                                                   "raw_scores": True})
    assert status == 200, answer
    tei = {r["index"]: r["score"] for r in answer}
    np.testing.assert_allclose([tei[i] for i in range(len(TEXTS))], logits, atol=RERANK_ATOL)


# --- refusals ----------------------------------------------------------------------------


def test_last_token_pooling_is_refused_for_an_artifact_exported_without_it(tiny_artifact):
    from attnserve.artifact import load_artifact
    from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
    from attnserve.server.errors import InvalidArgument
    from attnserve.server.grpc.encoder import plan_embed

    manifest = load_artifact(tiny_artifact).manifest
    request = pb.EmbedRequest(texts=["a"], pooling=pb.POOLING_LAST_TOKEN)
    assert plan_embed(request, manifest, "tiny").pooling == pb.POOLING_LAST_TOKEN
    older = dataclasses.replace(manifest, format_version=4)
    with pytest.raises(InvalidArgument) as refused:
        plan_embed(request, older, "tiny")
    assert refused.value.field == "pooling"
    assert "exported without last-token vectors (manifest format_version 4)" in str(refused.value)
