"""Promise: /openapi.json documents every route the HTTP port serves, and nothing it does
not: the port's own aiohttp app, as a server of one process builds it on a real model,
against the document that app serves."""

import orjson
import pytest

from attnserve.server.call import ApiKeys
from attnserve.server.config import ModelSource, ServeConfig
from attnserve.server.http.server import HttpServers
from tests.server.reliability import assembled


@pytest.fixture(scope="module")
def http(tiny_artifact) -> HttpServers:
    config = ServeConfig(artifact=(ModelSource(tiny_artifact),), device="cpu")
    plane, _ = assembled(config)
    return HttpServers(config, plane, plane.metrics, ApiKeys(None, None), 1024, metrics_port=False)


def test_every_route_served_is_documented_and_no_other(http):
    served = {(route.method.lower(), route.resource.canonical)
              for route in http.api.runner.app.router.routes() if route.method != "HEAD"}
    document = orjson.loads(http.document)
    documented = {(method, path) for path, operations in document["paths"].items()
                  for method in operations}
    assert served == documented, (served - documented, documented - served)
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert "200" in operation["responses"] and operation["tags"], (method, path)
            # Every body a route takes or answers with comes from a schema, never inline.
            for content in (operation.get("requestBody", {}).get("content", {}) | {
                    kind: body for answer in operation["responses"].values()
                    for kind, body in answer["content"].items()}).values():
                schema = content["schema"]
                assert schema.get("$ref") or schema.get("type") in ("array", "string", "object"), (
                    method, path, schema)
