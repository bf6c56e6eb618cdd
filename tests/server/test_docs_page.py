"""A browser's view, in headless Chromium (Debian's chromium and chromium-driver, driven by
selenium): /docs loads Swagger UI from the server alone, lists every route of
/openapi.json under its peer, and "Try it out" on /v1/embeddings returns the vector the
route returns; a page of an allowed origin (--cors-allow-origin) calls the API, and one
of another origin is stopped by the browser before its call reaches the server."""

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.harness import delta
from tests.server.reliability import serve
from tests.server.test_http import post

# Event waits in the browser, never a timing assertion: generous for a busy machine.
WAIT_S = 120
BODY = {"input": ["attention is all you need"]}


def need(program: str, package: str) -> str:
    path = shutil.which(program)
    if path is None:
        pytest.fail(f"{program} not found: install Debian's `{package}` package (make tools)")
    return path


class Blank(BaseHTTPRequestHandler):
    """An empty page: the origin the page's calls come from."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"<!DOCTYPE html><title>page</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def page_port():
    pages = ThreadingHTTPServer(("127.0.0.1", 0), Blank)
    thread = threading.Thread(target=pages.serve_forever, daemon=True)
    thread.start()
    yield pages.server_address[1]
    pages.shutdown()
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_artifact, page_port):
    # Only the page at 127.0.0.1 may call: the same page at localhost is another origin.
    with serve(tiny_artifact, "--cors-allow-origin", f"http://127.0.0.1:{page_port}") as process:
        yield process


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = need("chromium", "chromium")
    for argument in ("--headless", "--no-sandbox", "--disable-gpu",
                     "--disable-background-networking", "--disable-component-update",
                     "--disable-sync", "--no-first-run", "--window-size=1400,2400",
                     f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(need("chromedriver", "chromium-driver")),
                              options=options)
    driver.set_script_timeout(WAIT_S)
    yield driver
    driver.quit()


def wait(browser, condition):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, WAIT_S).until(condition)


def test_docs_lists_every_route_and_tries_embeddings(browser, server):
    from selenium.webdriver.common.by import By

    browser.get(server.http_url + "/docs")
    wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
    document = json.loads(browser.execute_script(
        "return fetch('/openapi.json').then(r => r.text())"))
    shown = {(e.get_attribute("data-path")) for e in
             browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert shown == set(document["paths"])
    sections = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-tag")}
    assert {"OpenAI", "Infinity", "Text Embeddings Inference",
            "KServe v2 (Open Inference Protocol)"} <= sections

    block = browser.find_element(By.ID, "operations-OpenAI-post_v1_embeddings")
    block.find_element(By.CSS_SELECTOR, ".opblock-summary").click()
    wait(browser, lambda b: block.find_elements(By.CSS_SELECTOR, ".try-out__btn"))
    block.find_element(By.CSS_SELECTOR, ".try-out__btn").click()
    wait(browser, lambda b: block.find_elements(By.CSS_SELECTOR, ".execute"))
    sent = json.loads(block.find_element(By.CSS_SELECTOR, "textarea.body-param__text")
                      .get_attribute("value"))
    block.find_element(By.CSS_SELECTOR, ".execute").click()
    answer = wait(browser, lambda b: block.find_elements(
        By.CSS_SELECTOR, ".live-responses-table tr.response"))[0]
    assert answer.find_element(By.CSS_SELECTOR, ".response-col_status").text.strip() == "200"
    shown_body = json.loads(answer.find_element(
        By.CSS_SELECTOR, ".response-col_description .microlight").text)
    status, expected = post(server.http_url + "/v1/embeddings", json.dumps(sent).encode())
    assert status == 200 and len(shown_body["data"][0]["embedding"]) > 0
    assert shown_body["data"] == expected["data"]
    # Nothing came from anywhere but this server.
    errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors, errors


FETCH = """const [url, done] = [arguments[0], arguments[arguments.length - 1]];
fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
            body: JSON.stringify(arguments[1])})
  .then(r => r.json()).then(d => done(d.data[0].embedding.length))
  .catch(e => done("refused: " + e));"""


def test_only_an_allowed_origins_page_may_call(browser, server, page_port):
    url = server.http_url + "/v1/embeddings"
    browser.get(f"http://127.0.0.1:{page_port}/")
    before = server.scrape()
    length = browser.execute_async_script(FETCH, url, BODY)
    assert isinstance(length, int) and length > 0, length
    middle = server.scrape()
    assert delta(before, middle, "attnserve_requests_total", rpc="http:/v1/embeddings") == 1

    browser.get(f"http://localhost:{page_port}/")
    refused = browser.execute_async_script(FETCH, url, BODY)
    assert isinstance(refused, str) and refused.startswith("refused: TypeError"), refused
    # The browser stopped at the preflight: the call never reached the route.
    after = server.scrape()
    assert delta(middle, after, "attnserve_requests_total", rpc="http:/v1/embeddings") == 0
