"""``rollout.max_staleness=auto`` in the config (asyncppo/config/validate_window.py): where auto starts, which knobs
the tuner may move, and the errors that name the key."""

from __future__ import annotations

import pytest

from asyncppo.config.loader import config_from_yaml, config_to_yaml, load_config
from asyncppo.config.validate import ConfigError


@pytest.mark.parametrize("overrides, k, j, auto", [
    (["rollout.max_staleness=auto"], 1, 1, "k=j"),  # the default config's number; null lookahead follows k
    # data=long says auto for both, from its start keys (12, 3); the command line's auto changes nothing
    (["data=long"], 12, 3, "k,j"),
    (["data=long", "rollout.max_staleness=auto", "rollout.admission_lookahead=auto"], 12, 3, "k,j"),
    (["data=long", "rollout.admission_lookahead=3"], 12, 3, "k"),  # a number pins j; k stays auto from 12
    (["data=long", "rollout.max_staleness=8"], 8, 3, "j"),  # a pinned k ignores its start key
    (["data=long", "rollout.max_staleness=2"], 2, 2, "j"),  # j's start (3) never above k
    (["data=long", "rollout.max_staleness=12", "rollout.admission_lookahead=3"], 12, 3, ""),  # the old preset
    (["data=guess"], 1, 1, "k,j"), (["data=calculator"], 1, 1, "k,j"), (["data=calculator_agent"], 1, 1, "k,j"),
    (["data=reverse"], 1, 1, ""), ([], 1, 1, ""),  # the default task keeps its fixed k = 1
    (["rollout.admission_lookahead=auto", "rollout.max_staleness=3"], 3, 3, "j"),
    # a start key wins over the number the command line's auto replaced (the default config's k = 1)
    (["rollout.max_staleness=auto", "rollout.max_staleness_start=6"], 6, 6, "k=j"),
    (["rollout.max_staleness=auto", "rollout.admission_lookahead=auto", "rollout.max_staleness_start=6",
      "rollout.admission_lookahead_start=2"], 6, 2, "k,j"),
    (["rollout.max_staleness=2"], 2, 2, ""),
])
def test_auto_starts_from_its_start_key_or_the_preset_number_and_records_the_tuned_knobs(overrides, k, j, auto):
    r = load_config(overrides).rollout
    assert (r.max_staleness, r.admission_lookahead, r.window_auto) == (k, j, auto)


def test_a_saved_auto_config_reloads_to_the_same_start_and_tuning():
    for overrides, auto in ((["data=long", "rollout.admission_lookahead=3", "rollout.tune_every=7"], "k"),
                            (["data=long"], "k,j")):
        cfg = load_config(overrides)
        again = config_from_yaml(config_to_yaml(cfg))
        assert again == cfg and again.rollout.window_auto == auto


def test_auto_without_a_number_anywhere_starts_at_the_documented_default():
    r = config_from_yaml("rollout: {max_staleness: auto}").rollout
    assert (r.max_staleness, r.window_auto) == (4, "k=j")


def test_bad_values_are_named():
    with pytest.raises(ConfigError) as e:
        load_config(["rollout.max_staleness=often", "rollout.tune_every=0", "algorithm.offpolicy_budget=0",
                     "rollout.max_staleness_cap=-1", "rollout.admission_lookahead_start=-2"])
    text = str(e.value)
    for key in ("rollout.max_staleness='often'", "rollout.tune_every=0", "algorithm.offpolicy_budget=0",
                "rollout.max_staleness_cap=-1", "rollout.admission_lookahead_start=-2"):
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


def test_a_start_beyond_the_cap_starts_at_the_cap_and_says_so():
    from asyncppo.config.validate import validate_config

    with pytest.warns(Warning, match="the auto window starts at the cap"):
        cfg = load_config(["data=long", "rollout.max_staleness_cap=6"])  # the preset's start 12, a user's cap 6
    assert cfg.rollout.max_staleness == 6
    raw = load_config(["data=long"])
    raw.rollout.max_staleness, raw.rollout.max_staleness_cap = "auto", 6
    warnings = validate_config(raw)
    assert any("rollout.max_staleness_start=12" in w and "max_staleness_cap=6" in w for w in warnings), warnings


@pytest.mark.parametrize("overrides, k, j, auto", [
    ([], 12, 3, "k,j"),  # as saved: data=long's auto window from its start
    (["rollout.max_staleness=8", "rollout.admission_lookahead=3"], 8, 3, ""),  # pinned on the command line: fixed
    (["rollout.max_staleness=8"], 8, 3, "j"),  # k pinned, j still tuned
    (["rollout.admission_lookahead=2"], 12, 2, "k"),
    (["rollout.admission_lookahead=null"], 12, 12, "k=j"),  # null: j follows k
    (["rollout.max_staleness=auto"], 12, 3, "k,j"),  # auto again: j keeps its saved tuning
    (["rollout.max_staleness=1"], 1, 1, "j"),  # the tuned j fitted under the pinned k, as a fresh launch's
    (["rollout.admission_lookahead=14"], 14, 14, "k"),  # the tuned k raised to the pinned j
    (["rollout.max_staleness_cap=8"], 8, 3, "k,j"),  # a lowered cap: the tuned k starts at it (with a warning)
])
def test_a_saved_auto_config_reloaded_under_overrides_pins_what_they_pin(tmp_path, overrides, k, j, auto):
    """A run's config.yaml holds the start ints and ``window_auto``; composed again with ``--config-file`` under
    overrides, a knob set to a number is pinned (before, the saved ``k,j`` kept moving a pinned window) and the
    other keeps its saved tuning."""
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(load_config(["data=long"])))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = load_config(overrides, config_file=path).rollout
    assert any("starts at the cap" in str(w.message) for w in caught) == ("rollout.max_staleness_cap=8" in overrides)
    assert (r.max_staleness, r.admission_lookahead, r.window_auto) == (k, j, auto)


def test_a_saved_tied_window_keeps_j_following_a_pinned_k(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(load_config(["rollout.max_staleness=auto"])))  # k=j, from k = 1
    r = load_config(["rollout.max_staleness=3"], config_file=path).rollout
    assert (r.max_staleness, r.admission_lookahead, r.window_auto) == (3, 3, "")


def test_a_pinned_window_says_nothing_of_the_presets_start_keys():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a start above the cap means nothing while both knobs are numbers
        load_config(["data=long", "rollout.max_staleness=4", "rollout.admission_lookahead=2",
                     "rollout.max_staleness_cap=8"])


def test_a_pinned_k_over_the_cap_is_refused_when_the_lookahead_is_tuned_however_it_got_there(tmp_path):
    """Whether j is auto by the preset's word, by the command line's, or by a saved config's tuning: a pinned k above
    the cap would leave the tuner no window it may hold (j <= k <= cap), so it is refused by name."""
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(load_config(["data=long"])))
    for kw in (dict(overrides=["data=long", "rollout.max_staleness=20"]),
               dict(overrides=["rollout.max_staleness=20", "rollout.admission_lookahead=auto"]),
               dict(overrides=["rollout.max_staleness=20"], config_file=path)):
        with pytest.raises(ConfigError, match="rollout.max_staleness=20: must be <= rollout.max_staleness_cap=16"):
            load_config(**kw)
