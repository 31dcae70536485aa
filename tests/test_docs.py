"""What a user reads is self-contained and true to the repository (issue 16, item 11)."""

from __future__ import annotations

import re

import pytest

from tests.entrypoints.openai.utils import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
        *sorted((REPO_ROOT / "vllm").rglob("README.md"))]
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_links_resolve_inside_the_repository(doc):
    """Every relative link points at a file of this repository: none leaves it (a user
    has no ../shared team workspace) and none is broken."""
    text = doc.read_text()
    assert "shared/DESIGN.md" not in text and "../shared" not in text
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path = (doc.parent / target).resolve()
        assert path.is_relative_to(REPO_ROOT.resolve()), f"{doc.name} links outside: {target}"
        assert path.exists(), f"{doc.name} links to a missing file: {target}"


def test_design_is_in_docs_and_linked_from_the_readme():
    readme = (REPO_ROOT / "README.md").read_text()
    assert (REPO_ROOT / "docs" / "design.md").is_file()
    assert "](docs/design.md)" in readme


def test_readme_commands_work_in_a_new_shell_after_make_serve():
    """`make serve` installs into .venv without activating it: the README must run the
    console script from there (or say how to activate), never a bare `vllm` command line."""
    readme = (REPO_ROOT / "README.md").read_text()
    assert ".venv/bin/vllm serve" in readme and "source .venv/bin/activate" in readme
    bare = [line for line in readme.splitlines() if re.match(r"\s*vllm\s", line)]
    assert not bare, bare
