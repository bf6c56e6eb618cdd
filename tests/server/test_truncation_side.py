"""Left truncation: a text too long for the model keeps its end and the model's special
tokens, token for token as `tokenizers` cuts it with enable_truncation(direction="left"),
for BERT's tokenizer and each family's; it is tokenized a suffix at a time, never whole,
and a prompt keeps its tokens after the leading special tokens. Through a real server:
gRPC, Tokenize, the OpenAI door and TEI's."""

import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from attnserve.client import EncoderClient
from attnserve.server.engine import tokenize
from attnserve.server.engine.tokenize import TextTokenizer, TooLong
from tests.families import FAMILIES, make_checkpoint
from tests.harness import ServerProcess, minilm_dir
from tests.server.test_hostile_units import Unlimited
from tests.server.test_http import post_json

POSITIONS = 128
PHRASE = ("Le chat dort.  The quick brown fox jumps over the lazy dog!\nDon't panic:\t3.5%\n\n"
          "服务 A 调用了配置中心 B。Быстрая лиса. ")
TEXTS = {
    "mixed": PHRASE * 40,
    # the end has no cut point for a few thousand characters: the suffix looks further
    # back, to a cut point or to the text's start
    "run at the end": "many words before it " * 60 + "x" * 2000,
    "longer run": "many words before it " * 60 + "x" * 5000,
    "short": "Hello world, don't panic!",
}


@pytest.fixture(scope="module", params=["bert", *FAMILIES])
def path(request, tmp_path_factory):
    if request.param == "bert":
        return minilm_dir() / "tokenizer.json"
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param)) / "tokenizer.json"


def reference(path, text: str, positions: int = POSITIONS):
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.enable_truncation(positions, direction="left")
    return tok.encode(text)


def content(path, text: str):
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("first_prefix", [8, 1], ids=["default", "growing"])
@pytest.mark.parametrize("name", list(TEXTS))
def test_left_truncation_is_tokenizers_own(path, monkeypatch, name, first_prefix):
    """`growing`: the first suffix holds one character a position, so it grows before it
    holds enough tokens."""
    monkeypatch.setattr(tokenize, "PREFIX_CHARS_PER_POSITION", first_prefix)
    text = TEXTS[name]
    (got,) = TextTokenizer(path, POSITIONS).encode([text], truncate=True, holds=Unlimited(),
                                                   details=True, left=True)
    expected = reference(path, text)
    assert got.ids.tolist() == expected.ids
    assert got.tokens == expected.tokens
    assert got.offsets == expected.offsets
    if name != "short":
        assert len(got.ids) == POSITIONS


def test_a_text_that_fits_is_not_cut(path):
    tokenizer = TextTokenizer(path, POSITIONS)
    text = TEXTS["short"]
    right, left = (tokenizer.encode([text], truncate=True, holds=Unlimited(), left=side)[0]
                   for side in (False, True))
    assert left.ids.tolist() == right.ids.tolist() == reference(path, text).ids


def test_left_truncation_works_a_suffix_at_a_time(path):
    """The working memory held is a suffix's, not the text's."""
    holds = Unlimited()
    text = TEXTS["mixed"] * 50
    TextTokenizer(path, POSITIONS).encode([text], truncate=True, holds=holds, left=True)
    assert holds.peak < tokenize.WORK_BYTES_PER_CHAR * len(text) / 10


def test_without_truncate_a_long_text_is_refused_either_way(path):
    with pytest.raises(TooLong):
        TextTokenizer(path, POSITIONS).encode([TEXTS["mixed"]], truncate=False,
                                              holds=Unlimited(), left=True)


def test_a_prompt_keeps_its_tokens_before_the_texts_end(path):
    text, prompt_text = TEXTS["mixed"], "query: "
    tokenizer = TextTokenizer(path, POSITIONS, {"query": prompt_text})
    prompt = tokenizer.prompts["query"]
    (got,) = tokenizer.encode([text], truncate=True, holds=Unlimited(), details=True,
                              prompt=prompt, left=True)
    head, tail = tokenizer.head_ids.tolist(), tokenizer.tail_ids.tolist()
    own = content(path, prompt_text).ids
    room = POSITIONS - len(head) - len(tail) - len(own)
    words = content(path, text)
    assert got.ids.tolist() == head + own + words.ids[-room:] + tail
    shift = len(prompt_text)
    assert got.offsets[len(head) + len(own):-len(tail)] == [
        (start + shift, end + shift) for start, end in reference(path, text).offsets[
            len(head) + len(own):-len(tail)]]
    # A text that fits after the prompt is the prompt and the text, read as one.
    (short,) = tokenizer.encode([TEXTS["short"]], truncate=True, holds=Unlimited(),
                                prompt=prompt, left=True)
    assert short.ids.tolist() == reference(path, prompt_text + TEXTS["short"]).ids


# --- served ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_artifact):
    with ServerProcess(tiny_artifact) as running:
        yield running


def test_every_door_cuts_a_text_at_its_start(server):
    """The tiny model reads MiniLM's tokenizer in 128 positions."""
    path = minilm_dir() / "tokenizer.json"
    texts = [TEXTS["mixed"], TEXTS["short"]]
    expected = [reference(path, text).ids for text in texts]
    with EncoderClient(server.address) as client:
        results = client.embed(texts, truncate=True, truncation_direction="left", normalize=True)
        assert [r.token_ids for r in results] == expected
        as_ids = client.embed(token_ids=expected, normalize=True)
        vectors = np.stack([r.pooled for r in results])
        np.testing.assert_allclose(vectors, np.stack([r.pooled for r in as_ids]), atol=1e-6)
        (tokenized, _) = client.tokenize(texts, truncate=True, truncation_direction="left")
        assert list(tokenized.ids) == expected[0]
        assert list(tokenized.offsets) == [x for pair in reference(path, texts[0]).offsets
                                           for x in pair]
        model = client.model_info().model
    api = openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0)
    for side in ("left", "Left"):  # TEI's clients write its names capitalised
        response = api.embeddings.create(model=model, input=texts, extra_body={
            "truncate": True, "truncation_direction": side})
        np.testing.assert_allclose(np.array([d.embedding for d in response.data]), vectors,
                                   atol=1e-6)
    status, tei = post_json(server, "/embed", {"inputs": texts, "truncate": True,
                                               "truncation_direction": "Left"})
    assert status == 200, tei
    np.testing.assert_allclose(np.array(tei), vectors, atol=1e-6)
