"""The documentation agrees with the code: docs/configuration.md is `attnserve serve --help`
(regenerate it with `make docs`), docs/operations.md has a runbook entry for every alert
rule, the README stays short, and every relative link in the pages leads to a file."""

import importlib.util
import re
import subprocess
import sys

import yaml

from tests.harness import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "deploy" / "README.md", *DOCS.glob("*.md")]


def generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_serve_help():
    done = subprocess.run([sys.executable, str(DOCS / "generate.py"), "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_flag_missing_from_the_page_is_found_and_written_back():
    generate = generator()
    page = (DOCS / "configuration.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `--max-batch-size"))
    stale = page.replace(row + "\n", "")
    assert generate.render(stale) != stale
    assert generate.render(stale) == page


def test_every_serve_flag_has_a_row():
    _, commands = generator().build_parser()
    flags = [a.option_strings[0] for a in commands["serve"]._actions
             if a.option_strings and a.dest != "help"]
    page = (DOCS / "configuration.md").read_text()
    assert [f for f in flags if f"| `{f}" not in page] == []


def test_every_alert_has_a_runbook_entry():
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "attnserve-rules.yml").read_text())
    alerts = [r["alert"] for group in rules["groups"] for r in group["rules"] if "alert" in r]
    assert alerts
    headings = set(re.findall(r"^### (\w+)$", (DOCS / "operations.md").read_text(), re.MULTILINE))
    assert [a for a in alerts if a not in headings] == []


def test_the_readme_is_at_most_250_lines_and_links_every_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in ("api", "configuration", "architecture", "memory", "operations", "reliability",
                 "benchmarks"):
        assert f"(docs/{page}.md)" in readme, page


def test_relative_links_lead_to_files():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []
