"""The Open Inference Protocol (KServe v2) beside EncoderService, through tritonclient too."""

import subprocess
import sys

import grpc
import numpy as np
import pytest

from attnserve.artifact import load_artifact
from attnserve.server._proto.inference import grpc_service_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as pb_grpc
from attnserve.server.runtime import Runtime

MODEL = "all-MiniLM-L6-v2"
IDS = np.array([[101, 7592, 2088, 999, 102], [101, 2748, 102, 0, 0]], dtype=np.int64)
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.int64)


@pytest.fixture(scope="module")
def stub(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def runtime(minilm_artifact):
    return Runtime(load_artifact(minilm_artifact), device="cpu", intra_op_threads=1)


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
def test_model_infer_matches_the_session_and_zeroes_padding(stub, runtime, raw):
    response = stub.ModelInfer(infer_request(raw=raw))
    assert response.id == "req-1" and response.model_name == MODEL
    hidden = output(response, "last_hidden_state")
    assert hidden.shape == (2, 5, 384)
    full = runtime.run(IDS[:1], MASK[:1]).hidden[0]
    short = runtime.run(IDS[1:, :3], MASK[1:, :3]).hidden[0]
    assert np.abs(hidden[0] - full).max() <= 1e-5
    assert np.abs(hidden[1, :3] - short).max() <= 1e-5
    assert not hidden[1, 3:].any()


def test_attention_outputs_all_layers_or_one(stub, runtime):
    response = stub.ModelInfer(infer_request(outputs=["attentions", "attentions.4"]))
    stacked, four = output(response, "attentions"), output(response, "attentions.4")
    assert stacked.shape == (6, 2, 12, 5, 5) and four.shape == (2, 12, 5, 5)
    expected = runtime.run(IDS[:1], MASK[:1], (4,)).attentions[4][0]
    assert np.abs(four[0] - expected).max() <= 1e-5
    np.testing.assert_array_equal(stacked[4], four)
    np.testing.assert_allclose(four[1, :, :3, :3].sum(-1), 1.0, atol=1e-5)


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


def test_tritonclient_gets_the_same_hidden_state(minilm_server, runtime, tmp_path):
    # Its own process: tritonclient registers its own `inference` protos, which clash with
    # the server's stubs in one descriptor pool.
    out = tmp_path / "hidden.npy"
    subprocess.run([sys.executable, "-c", TRITON_CALL, minilm_server.address, MODEL, str(out)],
                   check=True, timeout=60)
    hidden = np.load(out)
    assert hidden.shape == (1, 5, 384)
    assert np.abs(hidden[0] - runtime.run(IDS[:1], MASK[:1]).hidden[0]).max() <= 1e-5


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
