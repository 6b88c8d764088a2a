"""The drift-measure check (asyncppo/bench/drift_check.py): Spearman's correlation by hand, ties included, and the
launch rows read from run directories laid out as a window sweep leaves them."""

import json

import pytest

from asyncppo.bench.drift_check import correlations, seed_groups, spearman


def test_spearman_by_hand():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x: 0 1 2 3, y: 1.5 1.5 0 3 (a tie): centred x -1.5 -0.5 0.5 1.5, y 0 0 -1.5 1.5 -> 1.5 / sqrt(5 * 4.5)
    assert spearman([1, 2, 3, 4], [5, 5, 1, 9]) == pytest.approx(1.5 / (5 * 4.5) ** 0.5)
    assert spearman([1, 2], [1, 2]) is None and spearman([1, 2, 3], [7, 7, 7]) is None


def _run(root, seed, label, held, kls, lags):
    d = root / f"seed-{seed}" / label
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("\n".join(json.dumps({"reward/mean": 0.0, "actor/mismatch_kl": k,
                                                           "staleness/token_mean": g}) for k, g in zip(kls, lags)))
    (d / "summary.json").write_text(json.dumps({"eval_after": {"accuracy_sampled": held}}))


def test_launches_are_grouped_by_seed_and_each_measure_is_ranked_against_accuracy(tmp_path):
    # seed 0: the KL falls as accuracy rises (rho -1), the lag rises with it (rho +1); seed 1: both against
    for label, held, kl, lag in (("k1", 0.5, [0.03, 0.05], [1, 1]), ("k2", 0.6, [0.02, 0.02], [2, 2]),
                                 ("k4", 0.7, [0.01, 0.01], [4, 4])):
        _run(tmp_path, 0, label, held, kl, lag)
    for label, held, kl, lag in (("k1", 0.7, [0.01], [1]), ("k2", 0.6, [0.02], [2]), ("k4", 0.5, [0.03], [4])):
        _run(tmp_path, 1, label, held, kl, lag)
    (tmp_path / "seed-1" / "broken").mkdir()  # a launch that wrote nothing is left out
    groups = seed_groups([str(tmp_path)])
    assert [len(v) for v in groups.values()] == [3, 3]
    assert groups[str(tmp_path / "seed-0")][0]["actor/mismatch_kl"] == pytest.approx(0.04)
    c = correlations(groups)
    assert list(c["actor/mismatch_kl"]["per_seed"].values()) == pytest.approx([-1.0, -1.0])
    assert list(c["staleness/token_mean"]["per_seed"].values()) == pytest.approx([1.0, -1.0])
    assert c["staleness/token_mean"]["mean"] == pytest.approx(0.0)
