"""A reranker's (query, text) pairs, tokenized by the server, are what each family's own
tokenizer (transformers', as sentence-transformers calls it) makes of the pair: the same
ids, the text's side starting where its token types turn to 1 (BERT's); with truncate, the
text cut to fit (transformers' only_second), never the query; max_tokens_per_doc's cap; a
query that leaves no room for a text, or a pair too long without truncate, refused naming
which."""

import pytest

from attnserve.server.engine.tokenize import TextTokenizer, TooLong
from attnserve.server.memory.ledger import Ledger
from tests.families import RERANKER_FAMILIES, make_reranker

POSITIONS = 128
QUERY = "where does the cat sleep?"
TEXTS = ["Le chat dort sur le canapé.", "", "The quick brown fox jumps over the lazy dog.",
         "服务 A 调用了配置中心 B。"]
LONG = "the cat sleeps on the warm sofa while it rains " * 30


@pytest.fixture(scope="module", params=RERANKER_FAMILIES)
def tokenizers(request, tmp_path_factory):
    from transformers import AutoTokenizer

    directory = make_reranker(request.param, tmp_path_factory.mktemp(request.param))
    return (request.param, TextTokenizer(directory / "tokenizer.json", POSITIONS),
            AutoTokenizer.from_pretrained(str(directory)))


def holds():
    return Ledger(1 << 30).holds()


def test_pairs_are_the_tokenizers_own(tokenizers):
    family, ours, theirs = tokenizers
    ids, segments = ours.encode_pairs(QUERY, TEXTS, False, holds())
    for i, text in enumerate(TEXTS):
        # As a batch, as sentence-transformers calls it (alone, an empty text is no pair).
        expected = {name: value[0] for name, value in theirs([QUERY], [text]).items()}
        assert ids[i].tolist() == expected["input_ids"], (family, text)
        if family == "bert":
            assert segments[i] == expected["token_type_ids"].index(1)
    assert (segments is None) == (family != "bert")


def test_truncate_cuts_the_text_never_the_query(tokenizers):
    family, ours, theirs = tokenizers
    with pytest.raises(TooLong) as refused:
        ours.encode_pairs(QUERY, ["ok", LONG], False, holds())
    assert refused.value.index == 1 and "set truncate=true to cut the text" in refused.value.reason
    ids, _ = ours.encode_pairs(QUERY, ["ok", LONG], True, holds())
    cut = theirs(QUERY, LONG, truncation="only_second", max_length=POSITIONS)["input_ids"]
    assert len(ids[1]) == POSITIONS and ids[1].tolist() == cut
    assert ids[1][:len(theirs(QUERY)["input_ids"]) - 1].tolist() == theirs(QUERY)["input_ids"][:-1]
    capped, _ = ours.encode_pairs(QUERY, [LONG], False, holds(), max_text_tokens=5)
    assert capped[0].tolist() == theirs(QUERY, LONG, truncation="only_second",
                                        max_length=len(theirs([QUERY], [""])["input_ids"][0]) + 5
                                        )["input_ids"]
    with pytest.raises(TooLong) as refused:
        ours.encode_pairs(LONG, ["ok"], True, holds())
    assert refused.value.index == -1 and "leaving no room for a text" in refused.value.reason
