"""Prompts and Matryoshka sizes through a real `attnserve serve`, against
sentence-transformers: models it saved itself (SentenceTransformer(modules=[...]).save(),
so config_sentence_transformers.json and 1_Pooling are its own) over the tiny BERT, one
whose pooling leaves the prompt out (mean, include_prompt false) and one that pools it
(cls), exported and served beside the tiny model, which has neither prompts nor sizes,
with --default-prompt-name."""

import json
import re
import shutil
import subprocess

import grpc
import numpy as np
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from tokenizers import Tokenizer

from attnserve.artifact import MANIFEST
from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from tests.conftest import export
from tests.harness import ATTNSERVE, REPO, ServerProcess
from tests.server.test_http import post_json

PROMPTS = {"query": "query: ", "passage": "passage: ", "document": ""}
LONG_PROMPT = "Represent this sentence for searching relevant passages: "
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.",
         "attention is all you need", "a"]
ATOL = 1e-5


def st_model(checkpoint, pooling: str, include_prompt: bool, **kwargs):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    transformer = Transformer(str(checkpoint))
    return SentenceTransformer(modules=[transformer, Pooling(
        transformer.get_embedding_dimension(), pooling_mode=pooling,
        include_prompt=include_prompt)], device="cpu", **kwargs)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint):
    """(excluding, including): sentence-transformers models over the tiny BERT."""
    root = tmp_path_factory.mktemp("sentence-transformers")
    excluding, including = root / "excluding", root / "including"
    st_model(tiny_checkpoint, "mean", False, prompts=PROMPTS,
             default_prompt_name="query").save(str(excluding))
    st_model(tiny_checkpoint, "cls", True, prompts={"query": LONG_PROMPT}).save(str(including))
    # Matryoshka sizes where vLLM and jina's checkpoints keep them.
    config = json.loads((including / "config.json").read_text())
    (including / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16]}))
    return excluding, including


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, checkpoints):
    excluding, including = checkpoints
    return (export(tmp_path_factory.mktemp("excluding"), excluding, "--matryoshka-dims", "16,8"),
            export(tmp_path_factory.mktemp("including"), including))


SERVE_FLAGS = ("--default-prompt-name", "passage")


@pytest.fixture(scope="module")
def server(artifacts, tiny_artifact):
    excluding, including = artifacts
    with ServerProcess(excluding, "--artifact", f"including={including}", "--artifact",
                       f"tiny={tiny_artifact}", *SERVE_FLAGS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with EncoderClient(server.address) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.EncoderServiceStub(channel)


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def reference(checkpoints):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(checkpoints[0]), device="cpu")


@pytest.fixture(scope="module")
def tokenizer(checkpoints):
    tok = Tokenizer.from_file(str(checkpoints[0] / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    return tok


def pooled(results) -> np.ndarray:
    return np.stack([r.pooled for r in results])


def assert_same(ours: np.ndarray, theirs: np.ndarray) -> None:
    np.testing.assert_allclose(ours, theirs, atol=ATOL)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999


def field_of(err: grpc.RpcError) -> str:
    (detail,) = rpc_status.from_call(err).details
    bad = error_details_pb2.BadRequest()
    assert detail.Unpack(bad)
    return bad.field_violations[0].field


# --- prompts ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["query", "passage", "document"])
def test_prompts_leave_the_prompt_out_of_mean_pooling_as_sentence_transformers(
        client, reference, name):
    for normalize in (True, False):
        ours = pooled(client.embed(TEXTS, prompt_name=name, normalize=normalize))
        assert_same(ours, reference.encode(TEXTS, prompt_name=name,
                                           normalize_embeddings=normalize))
        assert_same(ours, reference.encode(TEXTS, prompt=PROMPTS[name],
                                           normalize_embeddings=normalize))


def test_a_pooled_prompt_would_give_other_vectors(client, tiny_checkpoint):
    """What the test above checks is not a rounding: pooling the prompt's tokens too moves
    the vectors."""
    pooling_it = st_model(tiny_checkpoint, "mean", True).encode(TEXTS, prompt="query: ",
                                                               normalize_embeddings=True)
    ours = pooled(client.embed(TEXTS, prompt_name="query", normalize=True))
    assert np.abs(ours - pooling_it).max() > 100 * ATOL


def test_the_default_prompt_is_the_flags_where_the_model_has_it(client, reference):
    assert_same(pooled(client.embed(TEXTS, normalize=True)),
                reference.encode(TEXTS, prompt_name="passage", normalize_embeddings=True))


def test_cls_pooling_takes_the_first_token_past_the_prompt(client, tiny_checkpoint):
    """sentence-transformers masks the prompt's tokens, its cls pooling then takes the first
    one left."""
    cls = st_model(tiny_checkpoint, "cls", False)
    assert_same(pooled(client.embed(TEXTS, prompt_name="query", pooling="cls", normalize=True)),
                cls.encode(TEXTS, prompt="query: ", normalize_embeddings=True))


def test_a_model_that_pools_its_prompt(client, checkpoints):
    from sentence_transformers import SentenceTransformer

    including = SentenceTransformer(str(checkpoints[1]), device="cpu")
    assert_same(pooled(client.embed(TEXTS, model="including", prompt_name="query", normalize=True)),
                including.encode(TEXTS, prompt_name="query", normalize_embeddings=True))
    # Its checkpoint has no default prompt and no prompt of the flag's name.
    assert_same(pooled(client.embed(TEXTS, model="including", normalize=True)),
                including.encode(TEXTS, normalize_embeddings=True))


def test_the_prompts_tokens_are_the_models_to_read_and_count(client, api, tokenizer):
    read = [PROMPTS["query"] + text for text in TEXTS]
    expected = [tokenizer.encode(text).ids for text in read]
    results = client.embed(TEXTS, prompt_name="query")
    assert [r.token_ids for r in results] == expected
    for tokenization, text in zip(client.tokenize(TEXTS, prompt_name="query"), read, strict=True):
        encoding = tokenizer.encode(text)
        assert list(tokenization.ids) == encoding.ids
        assert list(tokenization.tokens) == encoding.tokens
        # The offsets index the text the model reads: the prompt, then the text.
        pairs = list(zip(tokenization.offsets[0::2], tokenization.offsets[1::2], strict=True))
        assert pairs == [tuple(o) for o in encoding.offsets]
        assert text[pairs[1][0]:pairs[1][1]] == "query"
    response = api.embeddings.create(model="excluding", input=TEXTS,
                                     extra_body={"prompt_name": "query"})
    assert response.usage.prompt_tokens == sum(map(len, expected))


def test_the_openai_door_takes_a_prompt_name(api, reference):
    response = api.embeddings.create(model="excluding", input=TEXTS,
                                     extra_body={"prompt_name": "query"})
    assert_same(np.array([d.embedding for d in response.data]),
                reference.encode(TEXTS, prompt_name="query", normalize_embeddings=True))
    default = api.embeddings.create(model="excluding", input=TEXTS)
    assert_same(np.array([d.embedding for d in default.data]),
                reference.encode(TEXTS, prompt_name="passage", normalize_embeddings=True))


def tei(server, route: str, body: dict):
    status, answer = post_json(server, route, body)
    assert status == 200, answer
    return answer


def test_teis_routes_take_a_prompt_name_and_dimensions(server, reference, tokenizer, checkpoints):
    """TEI serves the default model, here `excluding`: its prompts, its default prompt and
    its sizes, as sentence-transformers' encode(prompt_name=..., truncate_dim=...)."""
    from sentence_transformers import SentenceTransformer

    assert_same(np.array(tei(server, "/embed", {"inputs": TEXTS, "prompt_name": "query"})),
                reference.encode(TEXTS, prompt_name="query", normalize_embeddings=True))
    assert_same(np.array(tei(server, "/", {"inputs": TEXTS})),
                reference.encode(TEXTS, prompt_name="passage", normalize_embeddings=True))
    cut = SentenceTransformer(str(checkpoints[0]), device="cpu", truncate_dim=8)
    sized = np.array(tei(server, "/embed", {"inputs": TEXTS, "prompt_name": "query",
                                            "dimensions": 8}))
    assert sized.shape == (len(TEXTS), 8)
    assert_same(sized, cut.encode(TEXTS, prompt_name="query", normalize_embeddings=True))
    # /embed_all: every token the model read, the prompt's among them.
    read = [PROMPTS["query"] + text for text in TEXTS]
    tokens = tei(server, "/embed_all", {"inputs": TEXTS, "prompt_name": "query"})
    assert [len(t) for t in tokens] == [len(tokenizer.encode(text).ids) for text in read]
    # /tokenize: the prompt's tokens too, each text's offsets into the prompt and the text.
    for got, text in zip(tei(server, "/tokenize", {"inputs": TEXTS, "prompt_name": "query"}),
                         read, strict=True):
        encoding = tokenizer.encode(text)
        assert [t["id"] for t in got] == encoding.ids
        assert [t["text"] for t in got if not t["special"]] == [
            text[a:b] for (a, b), special in zip(encoding.offsets, encoding.special_tokens_mask,
                                                 strict=True) if not special]
    status, error = post_json(server, "/embed", {"inputs": "a", "prompt_name": "nope"})
    assert (status, error["error_type"]) == (422, "Validation")
    assert error["error"].startswith("prompt_name: 'nope' is not a prompt of 'excluding'")


def test_a_prompt_runs_in_every_chunk(client, reference, tokenizer):
    """Isolated chunks are each the prompt and the chunk, pooled without the prompt; late
    windows hold the prompt's tokens too, so they hold fewer of the text's."""
    text = " ".join(TEXTS[1:3] * 6)
    (result,) = client.embed([text], prompt_name="query", chunk_tokens=12, isolated=True,
                             normalize=True)
    chunks = [text[c.start:c.end] for c in result.chunks]
    assert len(chunks) > 3
    assert_same(pooled(result.chunks), reference.encode(chunks, prompt_name="query",
                                                        normalize_embeddings=True))
    width = 128 - 2 - len(tokenizer.encode("query: ", add_special_tokens=False).ids)
    assert client.embed([text], prompt_name="query", chunk_tokens=width)[0].chunks
    with pytest.raises(grpc.RpcError) as err:
        client.embed([text], prompt_name="query", chunk_tokens=width + 1)
    assert f"expected 1 to {width}" in err.value.details()
    assert client.embed([text], prompt_name="document", chunk_tokens=width + 1)[0].chunks


# --- Matryoshka sizes ----------------------------------------------------------------------


@pytest.mark.parametrize("dimensions", [16, 8])
def test_dimensions_cut_as_truncate_dim(client, api, checkpoints, dimensions):
    from sentence_transformers import SentenceTransformer

    cut = SentenceTransformer(str(checkpoints[0]), device="cpu", truncate_dim=dimensions)
    for normalize in (True, False):
        ours = pooled(client.embed(TEXTS, prompt_name="query", normalize=normalize,
                                   dimensions=dimensions))
        assert ours.shape == (len(TEXTS), dimensions)
        assert_same(ours, cut.encode(TEXTS, prompt_name="query", normalize_embeddings=normalize))
    response = api.embeddings.create(model="excluding", input=TEXTS, dimensions=dimensions,
                                     extra_body={"prompt_name": "query"})
    assert_same(np.array([d.embedding for d in response.data]),
                cut.encode(TEXTS, prompt_name="query", normalize_embeddings=True))


def test_late_chunks_are_cut_too(client):
    text = " ".join(TEXTS[1:3] * 6)
    (whole,) = client.embed([text], chunk_tokens=12, normalize=True)
    (cut,) = client.embed([text], chunk_tokens=12, normalize=True, dimensions=8)
    first = pooled(whole.chunks)[:, :8]
    assert_same(pooled(cut.chunks), first / np.linalg.norm(first, axis=1, keepdims=True))


def test_only_declared_sizes_are_served(client, api):
    hidden = client.model_info("tiny").hidden_size
    assert pooled(client.embed(TEXTS, model="tiny", dimensions=hidden)).shape[1] == hidden
    assert pooled(client.embed(TEXTS, model="including", dimensions=16)).shape[1] == 16
    cases = [("excluding", 12, "'excluding' takes 32, 16, 8"),
             ("including", 8, "'including' takes 32, 16"),
             ("tiny", 16, "'tiny' declares no Matryoshka sizes: omit dimensions or set it to its "
                          "one size, 32")]
    for model, dimensions, reason in cases:
        with pytest.raises(grpc.RpcError) as err:
            client.embed(TEXTS, model=model, dimensions=dimensions)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == f"dimensions: {dimensions}; {reason}"
        assert field_of(err.value) == "dimensions"
        with pytest.raises(openai.BadRequestError) as bad:
            api.embeddings.create(model=model, input=TEXTS, dimensions=dimensions)
        assert bad.value.body["param"] == "dimensions" and reason in bad.value.body["message"]


# --- what the server says, and refuses ---------------------------------------------------


def saved_prompts(checkpoint) -> dict[str, str]:
    return json.loads((checkpoint / "config_sentence_transformers.json").read_text())["prompts"]


def test_model_info_lists_prompts_and_sizes(client, checkpoints):
    info = {m.model: m for m in client.list_models()}
    assert dict(info["excluding"].prompts) == saved_prompts(checkpoints[0]) == PROMPTS
    assert info["excluding"].default_prompt_name == "passage"
    assert list(info["excluding"].matryoshka_dims) == [16, 8]
    # sentence-transformers saves an empty "document" prompt beside those it is given.
    assert dict(info["including"].prompts) == saved_prompts(checkpoints[1])
    assert info["including"].prompts["query"] == LONG_PROMPT
    assert info["including"].default_prompt_name == ""
    assert list(info["including"].matryoshka_dims) == [16]
    assert not info["tiny"].prompts and not info["tiny"].matryoshka_dims


def test_the_start_up_log_says_each_models_default_prompt(server):
    log = server.output()
    assert re.search(r"event=default_prompt model=excluding prompt_name=passage "
                     r"prompts=document,passage,query", log), log[-3000:]
    for model, prompts in (("including", "document,query"), ("tiny", "none")):
        assert re.search(rf"level=WARNING .* event=default_prompt_missing model={model} "
                         rf"default_prompt_name=passage prompts={prompts} served_with=none", log)


BAD = [
    (dict(texts=TEXTS, prompt_name="nope"), "prompt_name",
     "prompt_name: 'nope' is not a prompt of 'excluding'; its prompts: 'document', 'passage', "
     "'query'"),
    (dict(texts=TEXTS, model="tiny", prompt_name="query"), "prompt_name",
     "prompt_name: 'query' is not a prompt of 'tiny'; it has none"),
    (dict(token_ids=[pb.TokenIds(ids=[101, 102])], prompt_name="query"), "prompt_name",
     "prompt_name: a prompt goes before texts: token ids are run as sent"),
    (dict(token_ids=[pb.TokenIds(ids=[101, 102])], truncate=True,
          truncation_direction=pb.TRUNCATION_DIRECTION_LEFT), "truncation_direction",
     "truncation_direction: left truncation keeps a text's special tokens"),
    (dict(texts=TEXTS, truncation_direction=7), "truncation_direction",
     "truncation_direction: unknown value 7"),
    (dict(texts=TEXTS, dimensions=16, pooling=pb.POOLING_NONE, return_token_embeddings=True),
     "dimensions", "dimensions: cuts the pooled vector: ask for one"),
]


@pytest.mark.parametrize("fields, field, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_fields_are_refused_by_name(stub, fields, field, message):
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(pb.EmbedRequest(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(message), err.value.details()
    assert field_of(err.value) == field


def test_tokenize_refuses_an_unknown_prompt(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Tokenize(pb.TokenizeRequest(texts=TEXTS, prompt_name="nope"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_of(err.value) == "prompt_name"


@pytest.mark.parametrize("body, param", [
    ({"prompt_name": "nope"}, "prompt_name"), ({"prompt_name": 3}, "prompt_name"),
    ({"truncation_direction": "middle"}, "truncation_direction"),
    ({"dimensions": 0}, "dimensions")])
def test_the_openai_door_refuses_by_name(api, body, param):
    with pytest.raises(openai.BadRequestError) as bad:
        api.embeddings.create(model="excluding", input=TEXTS, extra_body=body)
    assert bad.value.body["param"] == param


# --- --workers -----------------------------------------------------------------------------


def test_front_ends_pool_and_cut_as_one_process(artifacts, client):
    """With --workers the front end tokenizes and cuts; the spans that leave the prompt out
    cross to the engine process and their means come back."""
    long = " ".join(TEXTS * 40)
    asks = [dict(prompt_name="query", normalize=True), dict(dimensions=8),
            dict(pooling="cls", prompt_name="query"),
            dict(truncate=True, truncation_direction="left", prompt_name="query")]
    with ServerProcess(artifacts[0], "--workers", "2", *SERVE_FLAGS) as workers, \
            EncoderClient(workers.address) as front:
        for ask in asks:
            texts = [*TEXTS, long] if ask.get("truncate") else TEXTS
            got, expected = front.embed(texts, **ask), client.embed(texts, **ask)
            assert [r.token_ids for r in got] == [r.token_ids for r in expected]
            np.testing.assert_allclose(pooled(got), pooled(expected), atol=1e-6)


def test_a_prompt_that_leaves_a_text_no_room_is_refused_at_start(artifacts, tmp_path):
    target = tmp_path / "long-prompt"
    shutil.copytree(artifacts[0], target)
    data = json.loads((target / MANIFEST).read_text())
    data["prompts"]["long"] = "word " * 200
    (target / MANIFEST).write_text(json.dumps(data))
    done = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(target), "--check-config"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (f"--artifact {target}: {target / MANIFEST}: prompt 'long' and the special tokens "
            "take 128 or more of the model's positions, leaving none for a text") in done.stderr


def test_the_embed_command_takes_a_prompt_and_a_size(server, client, tmp_path):
    out, png = tmp_path / "vectors.npy", tmp_path / "map.png"
    done = subprocess.run([*ATTNSERVE, "embed", *TEXTS[:2], "--address", server.address,
                           "--prompt-name", "query", "--dimensions", "8", "--normalize",
                           "--out", str(out), "--heatmap", str(png)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_allclose(np.load(out), pooled(client.embed(
        TEXTS[:2], prompt_name="query", dimensions=8, normalize=True)), atol=1e-6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
