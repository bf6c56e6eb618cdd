"""Installing the project adds exactly one top-level import package, `attnserve`, and the
command works from what was installed, not from this checkout.

The wheel is built from a copy of the tree (the files git would carry, plus the generated
gRPC stubs and the allocation hook, which `make` writes and the wheel carries as package
data), so the build writes nothing into the checkout."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.harness import REPO

STUBS = REPO / "server" / "_proto"
HOOK = REPO / "server" / "memory" / "_alloc_peak.so"  # `make alloc-hook`, where there is a C compiler


def source_copy(target: Path) -> Path:
    assert (STUBS / "attnserve" / "v1" / "encoder_pb2.py").is_file(), \
        "no generated gRPC stubs in server/_proto: run `make proto` first"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():  # listed but deleted in the work tree: not part of it
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    shutil.copytree(STUBS, target / "server" / "_proto",
                    ignore=shutil.ignore_patterns("__pycache__"))
    if HOOK.is_file():
        shutil.copy2(HOOK, target / "server" / "memory" / HOOK.name)
    return target


def test_the_wheel_installs_one_top_level_package_that_works(tmp_path):
    source = source_copy(tmp_path / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("attnserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    assert {name.split("/", 1)[0] for name in names} == {"attnserve", wheel.name.split("-py")[0]
                                                         + ".dist-info"}
    assert "attnserve/server/_proto/attnserve/v1/encoder_pb2.py" in names
    # Every package of the server's layers, each of its modules (pyproject.toml lists them).
    for package in REPO.glob("server/**/__init__.py"):
        for module in package.parent.glob("*.py"):
            assert f"attnserve/{module.relative_to(REPO)}" in names, module
    assert ("attnserve/server/memory/_alloc_peak.so" in names) == HOOK.is_file()
    # The benchmarks and the test harness are repository tools, not part of the product.
    assert not any(name.startswith(("attnserve/tests/", "attnserve/deploy/", "attnserve/bench/"))
                   for name in names)

    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    probe = ("import attnserve.cli as cli, attnserve.server._proto.attnserve.v1.encoder_pb2 as pb; "
             "print(cli.__file__); print(pb.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # From the installed copy, not from this checkout (installed editable in the venv).
    for module_file in done.stdout.split():
        assert Path(module_file).is_relative_to(tmp_path / "site"), done.stdout
