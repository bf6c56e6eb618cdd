"""Promise: the HTTP port is what /openapi.json says it is. Schemathesis generates
requests from the document (valid ones and broken ones) for every route, sends them to a
real server, and checks each answer: no 5xx, only documented statuses and content types,
bodies that match their schemas. Bounded: a fixed number of examples per route."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.harness import delta
from tests.server.reliability import serve

EXAMPLES_PER_ROUTE = 30
# What the answers must be (the document cannot say that a schema-valid tensor's data fits
# its shape, so a schema-valid request may still get a documented 400).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, response_headers_conformance]


@pytest.fixture(scope="module")
def server(tiny_artifact):
    with serve(tiny_artifact, "--http-body-timeout-seconds", "5") as process:
        yield process
        log = process.output()
    assert "Traceback" not in log and "level=ERROR" not in log, log[-3000:]


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(server.http_url + "/openapi.json")


def test_every_route_answers_as_documented(api, server):
    before = server.scrape()
    failures = []
    for operation in (result.ok() for result in api.get_all_operations()):
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), database=None)
        def conforms(case):
            case.call_and_validate(checks=CHECKS, timeout=30)

        try:
            conforms()
        except Exception as failure:  # noqa: BLE001 - schemathesis's failures, with the request
            failures.append(f"{operation.label}: {failure}")
    assert not failures, "\n\n".join(failures)
    after = server.scrape()
    for rpc in ("http:/v1/embeddings", "http:/embeddings", "http:/v2/infer", "http:/v2/metadata",
                "http:/v2/ready", "http:/", "http:/embed", "http:/embed_all", "http:/tokenize",
                "http:/decode"):
        sent = delta(before, after, "attnserve_requests_total", rpc=rpc)
        assert sent >= EXAMPLES_PER_ROUTE // 2, (rpc, sent)
