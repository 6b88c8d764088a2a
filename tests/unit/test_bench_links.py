"""Links into the benchmark pages keep resolving: README.md and docs/ link to sections of docs/benchmarks.md (now
rendered) and of the diary it replaced (docs/benchmarks/history/), by anchor. Every such link must name a file that
exists and a heading it has, and the diary's own relative links must survive its move two folders down."""

from __future__ import annotations

import glob
import os
import re

import pytest
from test_bench_registry import headings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# docs/benchmarks/prose.md is left out: its text is rendered into docs/benchmarks.md, where its links are checked
PAGES = [os.path.join(REPO, "README.md"), *glob.glob(os.path.join(REPO, "docs", "*.md")),
         *glob.glob(os.path.join(REPO, "docs", "benchmarks", "history", "*.md"))]
LINK = re.compile(r"\]\(([^)\s#]+\.md)?(#[^)\s]+)?\)")


def links(page: str):
    with open(page, encoding="utf-8") as f:
        for target, anchor in LINK.findall(f.read()):
            if target.startswith(("http://", "https://")):
                continue
            yield target, anchor.lstrip("#")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, REPO))
def test_links_to_the_benchmark_pages_resolve(page):
    bad = []
    for target, anchor in links(page):
        path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
        benchmark_page = "benchmarks" in os.path.relpath(path, REPO)
        if not (benchmark_page or "benchmarks" in os.path.relpath(page, REPO)):
            continue  # this test owns the links into and out of the benchmark pages
        if not os.path.exists(path):
            bad.append(f"{target}: no such file")
        elif anchor and path.endswith(".md") and anchor not in headings(path):
            bad.append(f"{target}#{anchor}: no such heading")
    assert not bad, f"{os.path.relpath(page, REPO)}: {bad}"
