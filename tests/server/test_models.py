"""Promise: one server holds several models, each routed by name on every door. MiniLM and
the tests' tiny model (another family of shapes: 32 wide, 2 layers) served together: each
door's call for either model gets what that model's graphs give its input alone; a call
that names no model gets the first; an unknown name is NOT_FOUND (404) naming the models
served, in a bounded message; the listing routes (ListModels, OpenAI's /v1/models, KServe's
repository index) and each model's metadata say what is served; the metrics carry the
model. Starting with two artifacts of one name, an empty NAME=, or a path that is no
artifact exits 2 with one line naming the flag and the file."""

import json
import os
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import openai
import pytest
from grpc_status import rpc_status

from attnserve.artifact import load_artifact
from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.harness import ATTNSERVE, REPO, sample
from tests.server.reliability import Reference, infer_request, serve, stub, tensor

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

MINILM, TINY = "all-MiniLM-L6-v2", "tiny"
IDS = [101, 7592, 2088, 999, 102]
ATOL = 1e-5


@pytest.fixture(scope="module")
def server(minilm_artifact, tiny_artifact):
    with serve(minilm_artifact, "--artifact", f"{TINY}={tiny_artifact}") as process:
        yield process


@pytest.fixture(scope="module")
def references(minilm_artifact, tiny_artifact) -> dict[str, Reference]:
    return {MINILM: Reference(minilm_artifact), TINY: Reference(tiny_artifact)}


def hidden_of(references, model: str, ids: list[int]) -> np.ndarray:
    return references[model].run(ids)[0]


def test_attnserve_v1_routes_by_model_and_defaults_to_the_first(server, references):
    with grpc.insecure_channel(server.address) as channel:
        encoder = stub(channel)
        for model, name in ((MINILM, MINILM), (TINY, TINY), ("", MINILM)):
            response = encoder.Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=IDS)], model=model,
                                                     return_token_embeddings=True), timeout=60)
            assert response.model == name
            got = tensor(response.embeddings[0].token_embeddings)
            np.testing.assert_allclose(got, hidden_of(references, name, IDS), atol=ATOL)
        tokenized = encoder.Tokenize(pb.TokenizeRequest(texts=["hello world"], model=TINY),
                                     timeout=60)
        assert tokenized.model == TINY and list(tokenized.tokenizations[0].ids) == [101, 7592,
                                                                                    2088, 102]
        info = encoder.GetModelInfo(pb.GetModelInfoRequest(model=TINY), timeout=60)
        assert (info.model, info.hidden_size, info.num_layers) == (TINY, 32, 2)
        assert info.platform == "onnxruntime_onnx" and info.family == "bert"
        listed = encoder.ListModels(pb.ListModelsRequest(), timeout=60)
    assert [m.model for m in listed.models] == [MINILM, TINY] and listed.default_model == MINILM
    assert [m.hidden_size for m in listed.models] == [384, 32]


def test_the_python_client_and_the_cli_take_a_model(server, references):
    with EncoderClient(server.address) as client:
        (result,) = client.embed(token_ids=[IDS], model=TINY, token_embeddings=True)
        np.testing.assert_allclose(result.token_embeddings, hidden_of(references, TINY, IDS),
                                   atol=ATOL)
        assert [m.model for m in client.list_models()] == [MINILM, TINY]
        assert client.model_info(TINY).hidden_size == 32
    out = subprocess.run([*ATTNSERVE, "embed", "--address", server.address, "--model", TINY,
                          "--normalize", "hello world"], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert "dim=32 " in out.stdout, out.stdout


def not_found(call) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value
    return err.value.details()


def test_an_unknown_model_is_not_found_naming_those_served(server):
    long_name = "m" * 5000
    with grpc.insecure_channel(server.address) as channel:
        encoder, kserve = stub(channel), kpb_grpc.GRPCInferenceServiceStub(channel)
        for name in ("nope", long_name):
            calls = [
                lambda name=name: encoder.Embed(pb.EmbedRequest(texts=["hi"], model=name), timeout=30),
                lambda name=name: encoder.Tokenize(pb.TokenizeRequest(texts=["hi"], model=name),
                                                   timeout=30),
                lambda name=name: encoder.GetModelInfo(pb.GetModelInfoRequest(model=name), timeout=30),
                lambda name=name: kserve.ModelInfer(infer_request(name, [IDS]), timeout=30),
                lambda name=name: kserve.ModelMetadata(kpb.ModelMetadataRequest(name=name), timeout=30),
                lambda name=name: kserve.ModelReady(kpb.ModelReadyRequest(name=name), timeout=30),
            ]
            for call in calls:
                message = not_found(call)
                assert f"serves '{MINILM}', '{TINY}'" in message and len(message) < 400, message
        with pytest.raises(grpc.RpcError) as err:
            encoder.Embed(pb.EmbedRequest(texts=["hi"], model="nope"), timeout=30)
        status = rpc_status.from_call(err.value)
        assert status is not None and "model" in status.message
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model=long_name, input="hi")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    assert f"'{MINILM}', '{TINY}'" in missing.value.message and len(missing.value.message) < 400
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_openai_routes_by_model_and_lists_them(server, references):
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="x", max_retries=0)
    assert [m.id for m in client.models.list()] == [MINILM, TINY]
    assert client.models.retrieve(TINY).id == TINY
    for model, dims in ((MINILM, 384), (TINY, 32)):
        response = client.embeddings.create(model=model, input=[IDS])
        assert response.model == model
        vector = np.asarray(response.data[0].embedding)
        mean = hidden_of(references, model, IDS).mean(axis=0)
        assert vector.shape == (dims,)
        np.testing.assert_allclose(vector, mean / np.linalg.norm(mean), atol=1e-5)
    # No model: the default, as TEI's, Infinity's and vLLM's answer.
    raw = client.with_raw_response.embeddings.create(model=MINILM, input="hi")
    assert raw.http_response.status_code == 200
    body = json.dumps({"input": "hello"}).encode()
    request = urllib.request.Request(server.http_url + "/v1/embeddings", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert json.loads(answer.read())["model"] == MINILM


TRITON = """
import json, sys
import numpy as np
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp

address, http_address, out = sys.argv[1], sys.argv[2], sys.argv[3]
ids = np.array([[101, 7592, 2088, 999, 102]], dtype=np.int64)
found = {}
for kind, module, client in (("grpc", tgrpc, tgrpc.InferenceServerClient(address)),
                             ("http", thttp, thttp.InferenceServerClient(http_address))):
    index = client.get_model_repository_index()
    models = index.models if kind == "grpc" else index
    found[kind + "_index"] = [(m.name, m.state) if kind == "grpc" else (m["name"], m["state"])
                              for m in models]
    for model in ("all-MiniLM-L6-v2", "tiny"):
        assert client.is_model_ready(model)
        meta = client.get_model_metadata(model)
        found[f"{kind}_{model}_platform"] = meta.platform if kind == "grpc" else meta["platform"]
        inputs = [module.InferInput("input_ids", [1, 5], "INT64"),
                  module.InferInput("attention_mask", [1, 5], "INT64")]
        inputs[0].set_data_from_numpy(ids)
        inputs[1].set_data_from_numpy(np.ones_like(ids))
        result = client.infer(model, inputs,
                              outputs=[module.InferRequestedOutput("last_hidden_state")])
        np.save(f"{out}/{kind}-{model}.npy", result.as_numpy("last_hidden_state"))
print(json.dumps(found))
"""


def test_tritonclient_routes_by_model_on_both_kserve_doors(server, references, tmp_path):
    # Its own process: tritonclient registers its own `inference` protos, which clash with
    # the server's stubs in one descriptor pool.
    done = subprocess.run([sys.executable, "-c", TRITON, server.address,
                           f"127.0.0.1:{server.http_port}", str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    for kind in ("grpc", "http"):
        assert found[f"{kind}_index"] == [[MINILM, "READY"], [TINY, "READY"]]
        for model, width in ((MINILM, 384), (TINY, 32)):
            assert found[f"{kind}_{model}_platform"] == "onnxruntime_onnx"
            hidden = np.load(tmp_path / f"{kind}-{model}.npy")
            assert hidden.shape == (1, 5, width)
            np.testing.assert_allclose(hidden[0], hidden_of(references, model, IDS), atol=ATOL)


def test_the_metrics_carry_the_model(server):
    with EncoderClient(server.address) as client:
        before = server.scrape()
        client.embed(token_ids=[IDS], model=TINY)
        client.embed(token_ids=[IDS, IDS])
        after = server.scrape()
    for model, calls, sequences in ((TINY, 1, 1), (MINILM, 1, 2)):
        assert sample(after, "attnserve_requests_total", rpc="Embed", code="OK", model=model) - \
            sample(before, "attnserve_requests_total", rpc="Embed", code="OK", model=model) == calls
        assert sample(after, "attnserve_batch_size_sum", model=model) - \
            sample(before, "attnserve_batch_size_sum", model=model) == sequences
        assert sample(after, "attnserve_info", model=model) == 1
        assert (("attnserve_queue_depth", frozenset({("model", model)})) in after)


def failed_start(*flags: str) -> str:
    out = subprocess.run([*ATTNSERVE, "serve", "--check-config", "--device", "cpu", *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    lines = [line for line in out.stderr.splitlines() if line.startswith("attnserve serve:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


def test_start_up_refuses_what_cannot_be_served(tiny_artifact, minilm_artifact, tmp_path):
    name = load_artifact(tiny_artifact).manifest.model_name
    twice = failed_start("--artifact", str(tiny_artifact), "--artifact", str(tiny_artifact))
    assert "--artifact" in twice and f"both named {name!r}" in twice, twice
    renamed = failed_start("--artifact", str(minilm_artifact), "--artifact", f"{MINILM}={tiny_artifact}")
    assert f"both named {MINILM!r}" in renamed and str(tiny_artifact) in renamed, renamed
    for given in ("=", f"={tiny_artifact}"):
        empty = failed_start("--artifact", str(minilm_artifact), "--artifact", given)
        assert "--artifact" in empty and "empty NAME" in empty, empty
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    missing = failed_start("--artifact", f"x={nothing}")
    assert f"--artifact x={nothing}" in missing and "manifest.json" in missing, missing
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in tiny_artifact.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    graph = load_artifact(tiny_artifact).manifest.graph(attention=False, precision="fp32").file
    (damaged / graph).write_bytes(b"not a graph")
    broken = failed_start("--artifact", str(minilm_artifact), "--artifact", f"y={damaged}")
    assert "--artifact" in broken and graph in broken, broken


def test_the_environment_twin_takes_several_artifacts(tiny_artifact, minilm_artifact):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")},
           "ATTNSERVE_ARTIFACT": f"{minilm_artifact},{TINY}={tiny_artifact}"}
    out = subprocess.run([*ATTNSERVE, "serve", "--check-config", "--device", "cpu"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"models {MINILM} (" in out.stdout and f", {TINY} (" in out.stdout, out.stdout
