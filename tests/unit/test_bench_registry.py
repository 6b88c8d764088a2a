"""The benchmark registry (asyncppo/bench/registry.py): every entry complete and consistent, its options parsed from
the command line by type, and every committed result in docs/benchmarks/results/ one of its benchmarks, graded
against the target the registry fixes (not one of its own)."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

from asyncppo.bench.driver import OptionError, resolve_options
from asyncppo.bench.registry import BENCHMARKS, REGISTRY, format_list, get
from asyncppo.bench.render import slug
from asyncppo.bench.result import load

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "docs")


def headings(path: str) -> set[str]:
    """The anchors of a markdown file's headings (those inside code blocks are not headings)."""
    out, in_code = set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                in_code = not in_code
            elif not in_code and re.match(r"#{1,6} ", line):
                out.add(slug(line.lstrip("#")))
    return out


def test_names_titles_and_the_issue_48_list_are_all_there():
    assert len(REGISTRY) == len(BENCHMARKS)
    assert len({b.title for b in BENCHMARKS}) == len(BENCHMARKS)
    assert all(re.fullmatch(r"[a-z0-9-]+", b.name) for b in BENCHMARKS)
    asked = {"async-vs-sync", "limit", "peer", "tool-latency", "transport", "weight-sync", "shm-push", "tp-push",
             "fanout", "packing", "embodied", "lora", "advisor", "fault-drill"}
    assert asked <= set(REGISTRY)
    with pytest.raises(KeyError, match="no benchmark 'nope'"):
        get("nope")


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda b: b.name)
def test_an_entry_is_complete(bench):
    module, _, func = bench.runner.partition(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None, module
    with open(spec.origin, encoding="utf-8") as f:
        assert f"\ndef {func}(opts: dict, seed: int, work: str)" in f.read()
    assert bench.question.endswith("?") and bench.expected and bench.seeds
    if bench.target is not None:
        assert bench.target.figure == bench.headline and bench.target.why
        assert bench.target.min_seeds <= len(bench.seeds)
    if bench.quick is not None:
        assert set(bench.quick) <= set(bench.options) and bench.quick_expected
    for file, heading in bench.history:
        assert slug(heading) in headings(os.path.join(DOCS, file)), f"{bench.name}: no '{heading}' in {file}"


def test_the_list_shows_every_benchmark_with_its_target_and_time():
    text = format_list()
    for b in BENCHMARKS:
        assert re.search(rf"^{re.escape(b.name)}( \(quick\))? +~", text, re.M), b.name
        assert (b.target.describe() if b.target else "none (measures a cost)") in text


def test_options_are_typed_from_their_defaults_and_other_tokens_are_overrides():
    b = get("async-vs-sync")
    opts = resolve_options(b, ["steps=20", "limit=true", "modes=sync,async-cont", "trainer.seed=3", "data=long"])
    assert (opts["steps"], opts["limit"], opts["modes"]) == (20, True, ["sync", "async-cont"])
    assert opts["overrides"] == ["trainer.seed=3", "data=long"]
    assert b.options["steps"] == 60 and b.options["overrides"] == []  # the registry's defaults untouched
    quick = resolve_options(get("transport"), [], base=get("transport").quick)
    assert quick["shapes"] == ["8x128"] and quick["messages"] == 2000
    with pytest.raises(OptionError, match="steps='x': expected int"):
        resolve_options(b, ["steps=x"])
    with pytest.raises(OptionError, match="has no option 'trainer.seed'"):
        resolve_options(get("transport"), ["trainer.seed=1"])  # a microbenchmark takes no config overrides
    with pytest.raises(OptionError, match="expected bool"):
        resolve_options(b, ["limit=maybe"])


RESULTS = sorted(glob.glob(os.path.join(DOCS, "benchmarks", "results", "*.json")))


def test_there_is_a_committed_result_for_every_benchmark():
    assert {os.path.basename(p)[:-5] for p in RESULTS} == set(REGISTRY)


@pytest.mark.parametrize("path", RESULTS, ids=os.path.basename)
def test_a_committed_result_is_valid_and_graded_by_its_registered_target(path):
    result = load(path)  # validates: statistics from the per-seed values, the verdict from figures and target
    bench = REGISTRY[result.name]
    assert os.path.basename(path) == f"{bench.name}.json"
    assert result.target == bench.target, "the target in the file is not the one fixed in the registry"
    assert result.question == bench.question and result.headline == bench.headline
    assert result.source == "measured" or result.source.startswith("transcribed from ")
    if result.source != "measured":  # a transcription names the section it comes from
        assert re.search(r"\(.+\)", result.source), result.source
