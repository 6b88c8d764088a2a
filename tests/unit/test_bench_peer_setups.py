"""The peer benchmark's TRL setups by name (asyncppo/bench/peer.py: trl_mode) and one seed's figures against one
setup or several (peer_long.py: seed_figures), on hand-made curves."""

from __future__ import annotations

import pytest

from asyncppo.bench.peer import trl_mode
from asyncppo.bench.peer_long import seed_figures


def test_a_setup_name_says_what_trl_runs():
    assert trl_mode("spg1") == {"steps_per_generation": 1, "gradient_checkpointing": False, "generator": "generate"}
    assert trl_mode("spg4-cb") == {"steps_per_generation": 4, "gradient_checkpointing": False, "generator": "cb"}
    assert trl_mode("spg2-vllm-ckpt") == {"steps_per_generation": 2, "gradient_checkpointing": True,
                                          "generator": "vllm"}
    for bad in ("spg0", "spg", "cb", "spg4-cb-vllm", "spg1-ckpt-ckpt", "spg1-fast"):
        with pytest.raises(ValueError, match="TRL mode"):
            trl_mode(bad)


def _doc(*trls: str) -> dict:
    """asyncppo reaches start + 0.10 at 100 s; every TRL setup only at 300 s (its point at 200 s still below)."""
    asy = {"name": "asyncppo", "points": [{"train_s": 100.0, "sampled": 0.42}, {"train_s": 300.0, "sampled": 0.45}]}
    rows = [{"name": n, "points": [{"train_s": 200.0, "sampled": 0.33}, {"train_s": 300.0, "sampled": 0.41}]}
            for n in trls]
    return {"start": {"sampled": 0.30}, "results": [asy, *rows], "seconds": 300}


def test_one_setup_keeps_the_names_the_target_reads():
    f = seed_figures(_doc("trl"))
    # start + 0.10 = 0.40: TRL's last point below it is at 200 s, asyncppo's first above at 100 s -> 2x
    assert f["conservative speedup start+0.10"] == pytest.approx(2.0)
    assert f["conservative speedup, worst threshold"] == pytest.approx(2.0)
    assert f["mean sampled asyncppo"] == pytest.approx(0.435) and f["mean sampled trl"] == pytest.approx(0.37)


def test_several_setups_name_the_one_each_ratio_was_measured_against():
    f = seed_figures(_doc("trl:spg1", "trl:spg4-cb"))
    assert "conservative speedup, worst threshold" not in f  # no plain ratio: which setup would it be against?
    for name in ("trl:spg1", "trl:spg4-cb"):
        assert f[f"conservative speedup, worst threshold vs {name}"] == pytest.approx(2.0)
        assert f[f"mean sampled {name}"] == pytest.approx(0.37)
