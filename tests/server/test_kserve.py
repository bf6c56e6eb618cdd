"""The Open Inference Protocol (KServe v2) beside EncoderService, through tritonclient too."""

import subprocess
import sys

import grpc
import numpy as np
import pytest

from attnserve.server._proto.inference import grpc_service_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as pb_grpc
from tests.harness import minilm_dir
from tests.hugging_face import HuggingFace

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

MODEL = "all-MiniLM-L6-v2"
IDS = np.array([[101, 7592, 2088, 999, 102], [101, 2748, 102, 0, 0]], dtype=np.int64)
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.int64)
# Against Hugging Face's BertModel, both float32 (measured: under 2e-6 on these rows).
ATOL = 1e-5


@pytest.fixture(scope="module")
def stub(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def expected():
    """Hugging Face's hidden states and maps for each row of IDS, without its padding."""
    hf = HuggingFace(minilm_dir())
    return [hf.run(row[mask.astype(bool)].tolist()) for row, mask in zip(IDS, MASK, strict=True)]


def infer_request(ids=IDS, mask=MASK, outputs=(), raw=True, **overrides) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL, id="req-1")
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        tensor = request.inputs.add(name=name, datatype="INT64", shape=array.shape)
        if raw:
            request.raw_input_contents.append(array.astype("<i8").tobytes())
        else:
            tensor.contents.int64_contents.extend(array.ravel().tolist())
    for name in outputs:
        request.outputs.add(name=name)
    for key, value in overrides.items():
        setattr(request, key, value)
    return request


def output(response, name):
    index = [o.name for o in response.outputs].index(name)
    meta = response.outputs[index]
    assert meta.datatype == "FP32"
    return np.frombuffer(response.raw_output_contents[index], dtype="<f4").reshape(tuple(meta.shape))


def test_liveness_readiness_and_metadata(stub):
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
    assert stub.ServerMetadata(pb.ServerMetadataRequest()).name == "attnserve"
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL))
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1])]
    assert meta.outputs[0].name == "last_hidden_state" and list(meta.outputs[0].shape) == [-1, -1, 384]


@pytest.mark.parametrize("raw", [True, False])
def test_model_infer_matches_hugging_face_and_zeroes_padding(stub, expected, raw):
    response = stub.ModelInfer(infer_request(raw=raw))
    assert response.id == "req-1" and response.model_name == MODEL
    hidden = output(response, "last_hidden_state")
    assert hidden.shape == (2, 5, 384)
    (full, _), (short, _) = expected
    assert np.abs(hidden[0] - full).max() <= ATOL
    assert np.abs(hidden[1, :3] - short).max() <= ATOL
    assert not hidden[1, 3:].any()


def test_attention_outputs_all_layers_or_one_match_hugging_face(stub, expected):
    response = stub.ModelInfer(infer_request(outputs=["last_hidden_state", "attentions",
                                                      "attentions.4"]))
    hidden = output(response, "last_hidden_state")
    stacked, four = output(response, "attentions"), output(response, "attentions.4")
    assert stacked.shape == (6, 2, 12, 5, 5) and four.shape == (2, 12, 5, 5)
    for row, (want_hidden, maps) in enumerate(expected):
        n = maps.shape[-1]
        assert np.abs(hidden[row, :n] - want_hidden).max() <= ATOL
        # Every layer in its place, each row's maps over its own tokens only.
        assert np.abs(stacked[:, row, :, :n, :n] - maps).max() <= ATOL
        assert not stacked[:, row, :, n:, :].any() and not stacked[:, row, :, :, n:].any()
    np.testing.assert_array_equal(stacked[4], four)


TRITON_CALL = """
import sys
import numpy as np
import tritonclient.grpc as triton

client = triton.InferenceServerClient(sys.argv[1])
assert client.is_server_live() and client.is_model_ready(sys.argv[2])
ids = np.array([[101, 7592, 2088, 999, 102]], dtype=np.int64)
inputs = [triton.InferInput("input_ids", [1, 5], "INT64"),
          triton.InferInput("attention_mask", [1, 5], "INT64")]
inputs[0].set_data_from_numpy(ids)
inputs[1].set_data_from_numpy(np.ones_like(ids))
result = client.infer(sys.argv[2], inputs,
                      outputs=[triton.InferRequestedOutput("last_hidden_state")])
np.save(sys.argv[3], result.as_numpy("last_hidden_state"))
"""


def test_tritonclient_gets_the_same_hidden_state(minilm_server, expected, tmp_path):
    # Its own process: tritonclient registers its own `inference` protos, which clash with
    # the server's stubs in one descriptor pool.
    out = tmp_path / "hidden.npy"
    subprocess.run([sys.executable, "-c", TRITON_CALL, minilm_server.address, MODEL, str(out)],
                   check=True, timeout=60)
    hidden = np.load(out)
    assert hidden.shape == (1, 5, 384)
    assert np.abs(hidden[0] - expected[0][0]).max() <= ATOL


def test_bad_kserve_inputs_are_refused_with_the_reason(stub):
    cases = []
    wrong_name = infer_request()
    wrong_name.inputs[0].name = "ids"
    cases.append((wrong_name, grpc.StatusCode.INVALID_ARGUMENT, "inputs"))
    wrong_type = infer_request()
    wrong_type.inputs[1].datatype = "FP32"
    cases.append((wrong_type, grpc.StatusCode.INVALID_ARGUMENT, "datatype 'FP32'"))
    wrong_shape = infer_request()
    del wrong_shape.inputs[0].shape[:]
    wrong_shape.inputs[0].shape.extend([10])
    cases.append((wrong_shape, grpc.StatusCode.INVALID_ARGUMENT, "shape [10]"))
    short_bytes = infer_request()
    short_bytes.raw_input_contents[0] = short_bytes.raw_input_contents[0][:-8]
    cases.append((short_bytes, grpc.StatusCode.INVALID_ARGUMENT, "raw bytes"))
    cases.append((infer_request(model_name="other"), grpc.StatusCode.NOT_FOUND, "unknown model"))
    cases.append((infer_request(outputs=["logits"]), grpc.StatusCode.INVALID_ARGUMENT, "unknown output"))
    holes = MASK.copy()
    holes[0, 2] = 0
    cases.append((infer_request(mask=holes), grpc.StatusCode.INVALID_ARGUMENT, "attention_mask[0]"))
    big_id = IDS.copy()
    big_id[1, 1] = 40000
    cases.append((infer_request(ids=big_id), grpc.StatusCode.INVALID_ARGUMENT, "input_ids[1, 1]"))
    for request, code, text in cases:
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request)
        assert err.value.code() == code, err.value.details()
        assert text in err.value.details()
    assert output(stub.ModelInfer(infer_request()), "last_hidden_state").shape == (2, 5, 384)
