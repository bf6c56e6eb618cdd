"""Browsers' cross-origin calls (--cors-allow-origin), at the HTTP level: a preflight from an
allowed origin is answered with what it may send, before any API key is asked for; every
answer to it is marked for it, refusals too; a preflight from another origin, or to a
server that allows none (the default), gets no CORS header at all, so a browser never
sends the call. tests/server/test_docs_page.py runs the same in a real browser."""

import http.client
import json
from urllib.parse import urlsplit

import pytest

from tests.server.reliability import serve

PAGE = "http://page.example"
OTHER = "https://other.example:8443"
KEY = "cors-test-key"
BODY = json.dumps({"input": "hi"}).encode()


def call(server, method: str, path: str, headers: dict, body: bytes | None = None):
    """(status, headers, body) of one request, any method."""
    address = urlsplit(server.http_url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.headers, response.read()
    finally:
        connection.close()


def preflight(server, origin: str, method: str = "POST", path: str = "/v1/embeddings"):
    return call(server, "OPTIONS", path, {
        "Origin": origin, "Access-Control-Request-Method": method,
        "Access-Control-Request-Headers": "authorization, content-type"})


def cors_headers(headers) -> dict:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("access-control-")}


@pytest.fixture(scope="module")
def listed(tiny_artifact):
    with serve(tiny_artifact, "--cors-allow-origin", f"{PAGE},{OTHER}", "--api-key", KEY) as server:
        yield server


@pytest.fixture(scope="module")
def anyone(tiny_artifact):
    with serve(tiny_artifact, "--cors-allow-origin", "*") as server:
        yield server


def test_a_preflight_from_an_allowed_origin_is_answered_without_a_key(listed):
    for origin in (PAGE, OTHER):
        status, headers, body = preflight(listed, origin)
        assert status == 204 and not body
        assert cors_headers(headers) == {
            "access-control-allow-origin": origin,
            "access-control-allow-methods": "GET, POST",
            "access-control-allow-headers": "Authorization, Content-Type, "
                                            "Inference-Header-Content-Length",
            "access-control-max-age": "600"}
        assert "Origin" in headers.get("Vary", "")


def test_answers_to_an_allowed_origin_are_marked_refusals_too(listed):
    auth = {"Origin": PAGE, "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    status, headers, body = call(listed, "POST", "/v1/embeddings", auth, BODY)
    assert status == 200 and json.loads(body)["data"][0]["embedding"]
    assert cors_headers(headers) == {"access-control-allow-origin": PAGE}
    for path, key, code in (("/v1/embeddings", "wrong", 401), ("/embed", None, 401),
                            ("/nothing", KEY, 404), ("/embed", KEY, 422)):
        sent = {**auth, "Authorization": f"Bearer {key}"} if key else {
            "Origin": PAGE, "Content-Type": "application/json"}
        status, headers, _ = call(listed, "POST", path, sent, BODY)
        assert status == code and cors_headers(headers) == {"access-control-allow-origin": PAGE}


def test_other_origins_and_methods_get_no_cors_headers(listed, tiny_server):
    for server, origin, method in ((listed, "http://evil.example", "POST"),
                                   (listed, "http://page.example:8080", "POST"),
                                   (listed, PAGE, "DELETE"), (tiny_server, PAGE, "POST")):
        status, headers, _ = preflight(server, origin, method)
        assert status in (401, 405) and not cors_headers(headers), (origin, method, status)
    status, headers, _ = call(tiny_server, "POST", "/v1/embeddings",
                              {"Origin": PAGE, "Content-Type": "application/json"}, BODY)
    assert status == 200 and not cors_headers(headers) and "Vary" not in headers


def test_a_star_allows_any_origin_and_says_so(anyone):
    status, headers, _ = preflight(anyone, "http://anywhere.example", "GET", "/info")
    assert status == 204 and cors_headers(headers)["access-control-allow-origin"] == "*"
    status, headers, _ = call(anyone, "GET", "/info", {"Origin": "http://anywhere.example"})
    assert status == 200 and cors_headers(headers) == {"access-control-allow-origin": "*"}
    assert "Vary" not in headers
