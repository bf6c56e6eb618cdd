"""Fixtures the MiniLM API tests share: a client and a raw stub of attnserve.v1 on the
module's MiniLM server, and Hugging Face's reference model to compare it with; `encoder`,
a raw stub on the module's own `server`. A module
with a `client` or `stub` of another API defines its own, which takes precedence."""

import grpc
import pytest

from attnserve.client import EncoderClient
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from tests.harness import minilm_dir
from tests.hugging_face import HuggingFace


@pytest.fixture(scope="module")
def client(minilm_server):
    with EncoderClient(minilm_server.address) as c:
        yield c


@pytest.fixture(scope="module")
def stub(minilm_server):
    with grpc.insecure_channel(minilm_server.address) as channel:
        yield pb_grpc.EncoderServiceStub(channel)


@pytest.fixture(scope="module")
def encoder(server):
    """A raw stub of attnserve.v1 on the module's own `server`."""
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.EncoderServiceStub(channel)


@pytest.fixture(scope="module")
def hf():
    return HuggingFace(minilm_dir())
