"""The README stays a slime user's first screen, and every relative link of the documents resolves."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_is_short_and_opens_with_what_a_slime_job_needs():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    order = [text.index(marker) for marker in (
        "--rollout-function-path april_slime.rollout.generate_rollout", "april_policy: copris",
        "slime-forward-train-metadata.patch", "april-slime demo --quick", "bash scripts/test.sh")]
    assert order == sorted(order)


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(path.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(document):
    missing = [t for t in relative_links(document) if not (document.parent / t.split("#")[0]).exists()]
    assert missing == []


def test_a_broken_link_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[here](results/nothing.json) [web](https://example.org) [anchor](#top)\n")
    assert relative_links(page) == ["results/nothing.json"]
