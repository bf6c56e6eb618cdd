"""`make serve` in a checkout holding the default model's artifact without a memory model:
it keeps the artifact (current, said in one line), fits its memory model on this machine's
provider, and serves it. What `export --unless-current` does with a missing or outdated
artifact is tested in tests/export/test_unless_current.py."""

import json
import os
import shutil
import signal
import subprocess
import time

from attnserve.artifact import MEMORY_MODEL
from attnserve.client import EncoderClient
from attnserve.server.memory.model import ATTENTION, EMBEDDINGS
from tests.harness import REPO

START_TIMEOUT_S = 600
# The fit on a few short shapes: the fit itself is tested in tests/server/test_memory_profile.py,
# here that `make serve` makes one.
PROFILE_ARGS = "--seq-lens 8,16,32 --batch-sizes 1,2"


def test_make_serve_keeps_a_current_artifact_fits_its_memory_model_and_serves_it(minilm_artifact, tmp_path):
    artifact = tmp_path / "all-MiniLM-L6-v2"
    shutil.copytree(minilm_artifact, artifact)
    (artifact / MEMORY_MODEL).unlink(missing_ok=True)
    ready = tmp_path / "ready.json"
    serve_args = (f"--host 127.0.0.1 --port 0 --http-port 0 --metrics-port 0 "
                  f"--ready-file {ready}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    log = tmp_path / "make.log"
    with log.open("w") as out:
        make = subprocess.Popen(["make", "--no-print-directory", "serve", f"ARTIFACT={artifact}",
                                 f"SERVE_ARGS={serve_args}", f"PROFILE_ARGS={PROFILE_ARGS}"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            assert make.poll() is None, f"make serve exited {make.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not serving in {START_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.5)
        port = json.loads(ready.read_text())["port"]
        with EncoderClient(f"127.0.0.1:{port}") as client:
            (result,) = client.embed(["hello world"], normalize=True)
        assert result.pooled.shape == (384,)
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(60)

    said = [line for line in log.read_text().splitlines() if line.startswith(str(artifact))]
    assert said == [f"{artifact}: current, kept"], log.read_text()
    fitted = json.loads((artifact / MEMORY_MODEL).read_text())["models"]
    kinds = {key.rsplit("/", 1)[1] for key in fitted}
    assert kinds == {EMBEDDINGS, ATTENTION}, fitted
