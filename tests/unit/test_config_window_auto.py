"""``rollout.max_staleness=auto`` in the config (asyncppo/config/validate_window.py): where auto starts, which knobs
the tuner may move, and the errors that name the key."""

from __future__ import annotations

import pytest

from asyncppo.config.loader import config_from_yaml, config_to_yaml, load_config
from asyncppo.config.validate import ConfigError


@pytest.mark.parametrize("overrides, k, j, auto", [
    (["rollout.max_staleness=auto"], 1, 1, "k=j"),  # the default config's number; null lookahead follows k
    (["data=long", "rollout.max_staleness=auto"], 12, 3, "k"),  # the preset's k; its j=3 stays pinned
    (["data=long", "rollout.max_staleness=auto", "rollout.admission_lookahead=auto"], 12, 3, "k,j"),
    (["rollout.admission_lookahead=auto", "rollout.max_staleness=3"], 3, 3, "j"),
    (["data=long", "rollout.max_staleness=auto", "rollout.max_staleness_cap=6"], 6, 3, "k"),  # clipped to the cap
    (["rollout.max_staleness=2"], 2, 2, ""),
])
def test_auto_starts_from_the_preset_number_and_records_the_tuned_knobs(overrides, k, j, auto):
    r = load_config(overrides).rollout
    assert (r.max_staleness, r.admission_lookahead, r.window_auto) == (k, j, auto)


def test_a_saved_auto_config_reloads_to_the_same_start_and_tuning():
    cfg = load_config(["data=long", "rollout.max_staleness=auto", "rollout.tune_every=7"])
    again = config_from_yaml(config_to_yaml(cfg))
    assert again == cfg and again.rollout.window_auto == "k"


def test_auto_without_a_number_anywhere_starts_at_the_documented_default():
    r = config_from_yaml("rollout: {max_staleness: auto}").rollout
    assert (r.max_staleness, r.window_auto) == (4, "k=j")


def test_bad_values_are_named():
    with pytest.raises(ConfigError) as e:
        load_config(["rollout.max_staleness=often", "rollout.tune_every=0", "algorithm.offpolicy_budget=0",
                     "rollout.max_staleness_cap=-1"])
    text = str(e.value)
    for key in ("rollout.max_staleness='often'", "rollout.tune_every=0", "algorithm.offpolicy_budget=0",
                "rollout.max_staleness_cap=-1"):
        assert key in text, text


def test_an_auto_push_cadence_starts_at_one_and_reloads_the_same():
    """``rollout.sync_every=auto``: checked as 1 (its start and floor), so it fits every window, even k = 0;
    resolved to 1 with ``sync_auto`` set, which a saved config keeps."""
    cfg = load_config(["rollout.sync_every=auto", "rollout.max_staleness=0"])
    assert (cfg.rollout.sync_every, cfg.rollout.sync_auto) == (1, True)
    again = config_from_yaml(config_to_yaml(cfg))
    assert again == cfg and again.rollout.sync_auto
    fixed = load_config(["rollout.sync_every=2"]).rollout
    assert (fixed.sync_every, fixed.sync_auto) == (2, False)
    with pytest.raises(ConfigError, match=r"rollout.sync_every='often': must be an int >= 1 or \"auto\""):
        load_config(["rollout.sync_every=often"])
    with pytest.raises(ConfigError, match="rollout.sync_auto=True: is derived from rollout.sync_every=auto"):
        load_config(["rollout.sync_every=2", "rollout.sync_auto=true"])
