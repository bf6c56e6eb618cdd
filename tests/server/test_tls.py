"""Promise: transport security. --tls-cert/--tls-key serve TLS; --tls-client-ca requires
client certificates (mTLS); the metrics port is bound on its own; a plaintext client
against a TLS port fails cleanly and the server keeps serving. Certificates are made by
the test: a CA, a server certificate for 127.0.0.1 and localhost (SAN), a client
certificate, and a second CA nobody trusts."""

import datetime
import http.client
import ipaddress
import ssl
import subprocess
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from attnserve.client import EncoderClient
from tests.harness import ATTNSERVE, REPO
from tests.server.reliability import embed_ids, health, serve, stub

TIMEOUT_S = 10


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class Authority:
    def __init__(self, common: str):
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (x509.CertificateBuilder()
                     .subject_name(_name(common)).issuer_name(_name(common))
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .add_extension(x509.KeyUsage(
                         digital_signature=True, content_commitment=False, key_encipherment=False,
                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common: str, usage, names: list | None = None) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (x509.CertificateBuilder().subject_name(_name(common))
                   .issuer_name(self.cert.subject).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return _pem_key(key), cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pki")
    ca, rogue = Authority("attnserve test CA"), Authority("rogue CA")
    server_key, server_cert = ca.issue(
        "attnserve", ExtendedKeyUsageOID.SERVER_AUTH,
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")])
    client_key, client_cert = ca.issue("good client", ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue_key, rogue_cert = rogue.issue("rogue client", ExtendedKeyUsageOID.CLIENT_AUTH)
    files = {"ca.pem": ca.pem, "server.key": server_key, "server.pem": server_cert}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {"dir": folder, "ca": ca.pem, "rogue_ca": rogue.pem, "client": (client_key, client_cert),
            "rogue_client": (rogue_key, rogue_cert)}


def tls_flags(pki, mtls: bool) -> list[str]:
    folder: Path = pki["dir"]
    flags = ["--tls-cert", str(folder / "server.pem"), "--tls-key", str(folder / "server.key")]
    return flags + (["--tls-client-ca", str(folder / "ca.pem")] if mtls else [])


@pytest.fixture(scope="module")
def tls_server(tiny_artifact, pki):
    server = serve(tiny_artifact, *tls_flags(pki, mtls=False))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def mtls_server(tiny_artifact, pki):
    server = serve(tiny_artifact, *tls_flags(pki, mtls=True))
    yield server
    assert server.stop() == 0


def embed(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (grpc.secure_channel(address, credentials) if credentials
               else grpc.insecure_channel(address))
    with channel:
        try:
            response = stub(channel).Embed(embed_ids([[101, 7592, 102]]), timeout=TIMEOUT_S)
            assert len(response.embeddings) == 1
            return grpc.StatusCode.OK
        except grpc.RpcError as err:
            return err.code()


def test_tls_good_client_succeeds_and_plaintext_or_untrusting_clients_fail(tls_server, pki):
    assert "tls=True mtls=False" in tls_server.output()
    good = grpc.ssl_channel_credentials(pki["ca"])
    assert embed(tls_server.address, good) == grpc.StatusCode.OK
    # The project's own client speaks TLS too.
    with EncoderClient(tls_server.address, root_certificates=pki["ca"]) as client:
        assert client.embed(["hello"], timeout=TIMEOUT_S)[0].pooled.shape == (32,)
    # Plaintext against the TLS port: a clean UNAVAILABLE, not a hang.
    assert embed(tls_server.address, None) == grpc.StatusCode.UNAVAILABLE
    # A client that does not trust the server's CA refuses it.
    assert embed(tls_server.address, grpc.ssl_channel_credentials(pki["rogue_ca"])) == \
        grpc.StatusCode.UNAVAILABLE
    # The server shrugged it all off.
    assert health(tls_server.address, credentials=good) == "SERVING"
    assert embed(tls_server.address, good) == grpc.StatusCode.OK
    assert tls_server.proc.poll() is None


def test_mtls_refuses_clients_without_a_trusted_certificate(mtls_server, pki):
    assert "tls=True mtls=True" in mtls_server.output()
    key, cert = pki["client"]
    good = grpc.ssl_channel_credentials(pki["ca"], key, cert)
    assert embed(mtls_server.address, good) == grpc.StatusCode.OK
    no_cert = grpc.ssl_channel_credentials(pki["ca"])
    assert embed(mtls_server.address, no_cert) == grpc.StatusCode.UNAVAILABLE
    rogue_key, rogue_cert = pki["rogue_client"]
    rogue = grpc.ssl_channel_credentials(pki["ca"], rogue_key, rogue_cert)
    assert embed(mtls_server.address, rogue) == grpc.StatusCode.UNAVAILABLE
    assert embed(mtls_server.address, None) == grpc.StatusCode.UNAVAILABLE
    assert embed(mtls_server.address, good) == grpc.StatusCode.OK
    assert health(mtls_server.address, credentials=good) == "SERVING"


def test_metrics_port_is_bound_on_its_own_in_plain_http(tls_server):
    """The scrape port is separate: plain HTTP there, while the gRPC port speaks only TLS."""
    assert tls_server.metrics_port != tls_server.port
    samples = tls_server.scrape()
    assert any(name == "attnserve_requests_total" for name, _ in samples)
    with pytest.raises((OSError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.port}/metrics", timeout=TIMEOUT_S)


def test_http_port_speaks_only_tls_with_the_same_certificates(tls_server, mtls_server, pki, tmp_path):
    """No plaintext inference port is left open beside the encrypted gRPC one."""
    trusting = ssl.create_default_context(cadata=pki["ca"].decode())
    with urllib.request.urlopen(f"https://127.0.0.1:{tls_server.http_port}/health", context=trusting,
                                timeout=TIMEOUT_S) as response:
        assert response.status == 200
    with pytest.raises((OSError, http.client.HTTPException)):
        urllib.request.urlopen(f"http://127.0.0.1:{tls_server.http_port}/health", timeout=TIMEOUT_S)
    mtls_url = f"https://127.0.0.1:{mtls_server.http_port}/health"
    with pytest.raises((OSError, http.client.HTTPException)):  # no client certificate
        urllib.request.urlopen(mtls_url, context=trusting, timeout=TIMEOUT_S)
    key, cert = pki["client"]
    (tmp_path / "client.key").write_bytes(key)
    (tmp_path / "client.pem").write_bytes(cert)
    trusting.load_cert_chain(tmp_path / "client.pem", tmp_path / "client.key")
    with urllib.request.urlopen(mtls_url, context=trusting, timeout=TIMEOUT_S) as response:
        assert response.status == 200


@pytest.mark.parametrize("flags,why", [
    (["--tls-cert", "{dir}/server.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-client-ca", "{dir}/ca.pem"], "--tls-client-ca needs --tls-cert and --tls-key"),
    (["--tls-cert", "{dir}/server.pem", "--tls-key", "{dir}/absent.key"], "absent.key"),
])
def test_incomplete_tls_settings_stop_the_start(tiny_artifact, pki, flags, why):
    flags = [f.format(dir=pki["dir"]) for f in flags]
    done = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--host",
                           "127.0.0.1", "--port", "0", "--metrics-port", "0", "--device", "cpu",
                           *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert why in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
