"""Promise: a sequence classifier of several labels (multi-label: a sigmoid each) is served
on every classification door, each text's and each (text, text_pair)'s scores equal to
transformers' (its text-classification pipeline, its logits for raw scores) within 1e-4:
attnserve.v1 Classify (every label, highest first, top_k), TEI's /predict and its root
(single, pair and batch inputs, raw_scores; huggingface_hub's
InferenceClient.text_classification unchanged) and vLLM's /classify (scores by label id).
Bad input is refused naming the field on every door: no texts, top_k under 1, an
embedding model asked to classify and the classifier asked to embed. One server holds the
classifier (its default) and MiniLM."""

import json
import subprocess
import urllib.request
from pathlib import Path

import huggingface_hub
import numpy as np
import pytest
from huggingface_hub import InferenceClient

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.harness import ATTNSERVE, REPO, delta
from tests.server.reliability import serve
from tests.server.test_http import post_json
from tests.server.test_rerank import invalid

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

CLASSIFIER, MINILM = "classifier", "minilm"
LABELS = ["label_0", "label_1", "label_2"]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "ok",
         "Self-attention lets every token look at every other token."]
PAIR = ("A man is eating food.", "Someone eats.")
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(multi_label_classifier, minilm_artifact):
    named = Path(f"{CLASSIFIER}={multi_label_classifier[1].directory}")  # --artifact NAME=DIR
    with serve(named, "--artifact", f"{MINILM}={minilm_artifact}") as process:
        yield process


@pytest.fixture(scope="module")
def logits(multi_label_classifier):
    """text or (text, text_pair) -> transformers' logits [labels]; the pipeline's sigmoid
    scores checked against them once."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    checkpoint = str(multi_label_classifier[0])
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint).eval()

    def run(text, pair=None):
        import torch

        with torch.no_grad():
            return model(**tokenizer(text, pair, return_tensors="pt")).logits[0].numpy()

    table = {text: run(text) for text in TEXTS} | {PAIR: run(*PAIR)}
    classify = pipeline("text-classification", top_k=None, tokenizer=tokenizer, model=model)
    for text, labels in zip(TEXTS, classify(TEXTS), strict=True):
        got = sigmoid(table[text])
        np.testing.assert_allclose([got[LABELS.index(s["label"])] for s in labels],
                                   [s["score"] for s in labels], atol=ATOL)
    return table


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def by_label(scores: list[dict]) -> np.ndarray:
    """{label, score} entries, highest first, as scores by label id."""
    values = [s["score"] for s in scores]
    assert values == sorted(values, reverse=True), scores
    return np.array([{s["label"]: s["score"] for s in scores}[label] for label in LABELS])


@pytest.mark.workers
def test_grpc_classify_scores_every_label_of_texts_and_pairs(encoder, logits):
    inputs = [pb.ClassifyInput(text=t) for t in TEXTS] + [
        pb.ClassifyInput(text=PAIR[0], text_pair=PAIR[1])]
    keys = [*TEXTS, PAIR]
    response = encoder.Classify(pb.ClassifyRequest(model=CLASSIFIER, inputs=inputs), timeout=60)
    assert response.model == CLASSIFIER and response.total_tokens > 0
    for key, found in zip(keys, response.classifications, strict=True):
        got = by_label([{"label": s.label, "score": s.score} for s in found.scores])
        assert [LABELS[s.id] for s in found.scores] == [s.label for s in found.scores]
        np.testing.assert_allclose(got, sigmoid(logits[key]), atol=ATOL)
    raw = encoder.Classify(pb.ClassifyRequest(inputs=inputs, raw_scores=True, top_k=1),
                           timeout=60)  # the first classifier, as no model is named
    for key, found in zip(keys, raw.classifications, strict=True):
        (best,) = found.scores
        assert best.id == int(logits[key].argmax())
        assert best.score == pytest.approx(float(logits[key].max()), abs=ATOL)


def test_the_client_and_the_classify_command(server, logits):
    """EncoderClient.classify and `attnserve classify`, texts and a pair, as a user calls
    them; the call's priority class reaches the queue from Classify's own field."""
    before = server.scrape()
    with EncoderClient(server.address) as client:
        found = client.classify([TEXTS[0], PAIR[0]], text_pairs=[None, PAIR[1]],
                                model=CLASSIFIER, priority="bulk")
        (best,) = client.classify([TEXTS[1]], raw_scores=True, top_k=1)[0]
    assert delta(before, server.scrape(), "attnserve_queue_wait_seconds_count",
                 model=CLASSIFIER, priority="bulk") == 1
    for key, scores in zip([TEXTS[0], PAIR], found, strict=True):
        np.testing.assert_allclose(by_label([vars(s) for s in scores]), sigmoid(logits[key]),
                                   atol=ATOL)
    assert best.label == LABELS[int(logits[TEXTS[1]].argmax())]
    assert best.score == pytest.approx(float(logits[TEXTS[1]].max()), abs=ATOL)
    done = subprocess.run([*ATTNSERVE, "classify", PAIR[0], "--pair", PAIR[1], "--address",
                           server.address, "--model", CLASSIFIER], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.strip().split(": ", 1)[1].split("  ")
    scores = {label: float(score) for label, score in (entry.split() for entry in printed)}
    np.testing.assert_allclose([scores[label] for label in LABELS], sigmoid(logits[PAIR]),
                               atol=ATOL)


@pytest.mark.workers
def test_tei_predict_answers_singles_pairs_and_batches(server, logits):
    status, single = post_json(server, "/predict", {"inputs": TEXTS[0]})
    assert status == 200
    np.testing.assert_allclose(by_label(single), sigmoid(logits[TEXTS[0]]), atol=ATOL)
    status, pair = post_json(server, "/predict", {"inputs": list(PAIR)})
    assert status == 200
    np.testing.assert_allclose(by_label(pair), sigmoid(logits[PAIR]), atol=ATOL)
    status, batch = post_json(server, "/", {"inputs": [[TEXTS[1]], list(PAIR)],
                                            "raw_scores": True})
    assert status == 200 and len(batch) == 2
    for key, found in zip([TEXTS[1], PAIR], batch, strict=True):
        np.testing.assert_allclose(by_label(found), logits[key], atol=ATOL)
    with urllib.request.urlopen(server.http_url + "/info", timeout=30) as response:
        info = json.loads(response.read())
    assert info["model_type"]["classifier"]["id2label"] == dict(zip("012", LABELS, strict=True))


@pytest.mark.workers
def test_huggingface_hub_text_classification(server, logits, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(base_url=server.http_url)
    found = client.text_classification(TEXTS[2])
    np.testing.assert_allclose(by_label([{"label": e.label, "score": e.score} for e in found]),
                               sigmoid(logits[TEXTS[2]]), atol=ATOL)
    (best,) = client.text_classification(TEXTS[2], top_k=1, function_to_apply="none")
    assert best.label == LABELS[int(logits[TEXTS[2]].argmax())]
    assert best.score == pytest.approx(float(logits[TEXTS[2]].max()), abs=ATOL)


@pytest.mark.workers
def test_vllm_classify_scores_by_label_id(server, logits):
    status, answer = post_json(server, "/classify", {"model": CLASSIFIER, "input": TEXTS})
    assert status == 200, answer
    assert answer["object"] == "list" and answer["id"].startswith("classify-")
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0
    for i, (text, item) in enumerate(zip(TEXTS, answer["data"], strict=True)):
        assert (item["index"], item["num_classes"]) == (i, 3)
        np.testing.assert_allclose(item["probs"], sigmoid(logits[text]), atol=ATOL)
        assert item["label"] == LABELS[int(logits[text].argmax())]
    status, raw = post_json(server, "/classify", {"input": TEXTS[1], "use_activation": False})
    assert status == 200
    np.testing.assert_allclose(raw["data"][0]["probs"], logits[TEXTS[1]], atol=ATOL)


@pytest.mark.parametrize("request_, field", [
    (pb.ClassifyRequest(model=CLASSIFIER), "inputs"),
    (pb.ClassifyRequest(model=CLASSIFIER, inputs=[pb.ClassifyInput(text="a")], top_k=0), "top_k"),
    (pb.ClassifyRequest(model=MINILM, inputs=[pb.ClassifyInput(text="a")]), "model"),
])
def test_grpc_bad_classify_is_refused_naming_the_field(encoder, request_, field):
    found, message = invalid(lambda: encoder.Classify(request_, timeout=60))
    assert found == field, message


def test_the_classifier_asked_to_embed_is_refused_naming_the_model(encoder, server):
    found, message = invalid(lambda: encoder.Embed(pb.EmbedRequest(model=CLASSIFIER, texts=["a"]),
                                                   timeout=60))
    assert found == "model" and "a classifier" in message, message
    status, answer = post_json(server, "/embed", {"inputs": "a"})  # TEI's: the default model
    assert status == 422 and "a classifier" in answer["error"], answer
    status, answer = post_json(server, "/v1/embeddings", {"model": CLASSIFIER, "input": "a"})
    assert status == 400 and answer["error"]["param"] == "model", answer


@pytest.mark.parametrize("path, body, status, field", [
    ("/predict", {"inputs": []}, 400, "inputs"),
    ("/predict", {"inputs": ""}, 400, "inputs"),
    ("/predict", {"inputs": ["a", "b", "c"]}, 422, "inputs"),
    ("/predict", {"inputs": [["a"], ["b", ""]]}, 400, "inputs[1][1]"),
    ("/predict", {"inputs": "a", "model": MINILM}, 422, "model"),
    ("/", {"inputs": "a", "parameters": {"top_k": 0}}, 422, "parameters.top_k"),
    ("/classify", {"input": []}, 400, "input"),
    ("/classify", {"input": "a", "model": MINILM}, 400, "model"),
    ("/classify", {"input": "a", "messages": []}, 400, "messages"),
])
def test_http_bad_classify_is_refused_naming_the_field(server, path, body, status, field):
    found, answer = post_json(server, path, body)
    assert found == status, answer
    message = answer["error"]["message"] if path == "/classify" else answer["error"]
    assert field in message, answer
