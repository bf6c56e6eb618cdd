"""`--precision fp16` served end to end (onnxruntime's CPU provider runs the float16
graphs): the server says it serves fp16, and what callers get stays near Hugging Face's
float32 answer, with attention maps from a softmax kept in float32, so they sum to one."""

import numpy as np
import pytest

from attnserve.client import EncoderClient
from tests.harness import ServerProcess
from tests.hugging_face import FP16_HIDDEN_ATOL, FP16_MAPS_ATOL, HuggingFace
from tests.server.reliability import ids_of

FP32_LIKE = 1e-4
# A float16 softmax would be off by ~1e-3; float32 keeps each row's sum within ~2e-7.
ROW_SUM_ATOL = 1e-5


@pytest.fixture(scope="module")
def server(tiny_fp16_artifact):
    with ServerProcess(tiny_fp16_artifact, "--precision", "fp16") as process:
        yield process


def test_the_server_says_it_serves_fp16(server):
    with EncoderClient(server.address) as client:
        assert client.model_info().precision == "fp16"
    info = [labels for (name, labels) in server.scrape() if name == "attnserve_info"]
    assert len(info) == 1 and dict(info[0])["precision"] == "fp16"


def test_fp16_answers_stay_near_hugging_face(server, tiny_checkpoint):
    hf = HuggingFace(tiny_checkpoint)
    rng = np.random.default_rng(11)
    sequences = [ids_of(rng, n) for n in (3, 17, 40, 128)]
    with EncoderClient(server.address) as client:
        plain = client.embed(token_ids=sequences, token_embeddings=True)
        mapped = client.embed(token_ids=sequences, token_embeddings=True, attention_layers=[])
    worst = 0.0
    for ids, alone, with_maps in zip(sequences, plain, mapped, strict=True):
        hidden, maps = hf.run(ids)
        for got in (alone.token_embeddings, with_maps.token_embeddings):
            worst = max(worst, float(np.abs(got - hidden).max()))
        assert np.abs(with_maps.attentions - maps).max() <= FP16_MAPS_ATOL
        np.testing.assert_allclose(with_maps.attentions.sum(-1), 1.0, atol=ROW_SUM_ATOL)
    # Near, and visibly float16: the float32 graphs would be within ~1e-6.
    assert FP32_LIKE < worst <= FP16_HIDDEN_ATOL, worst
