"""final/ written whole or not at all (learner/final_model.py), on real directories."""

from __future__ import annotations

import os

import pytest

from asyncppo.learner.final_model import write_whole


def _save(text):
    def save(path):
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            f.write(text)
    return save


def test_written_aside_then_renamed_and_an_earlier_one_replaced(tmp_path):
    final = tmp_path / "final"
    write_whole(str(final), _save("one"))
    assert (final / "config.json").read_text() == "one"
    write_whole(str(final), _save("two"))  # a run resumed in its own directory saves again
    assert (final / "config.json").read_text() == "two"
    assert sorted(os.listdir(tmp_path)) == ["final"]  # nothing left beside it


def test_a_failed_write_leaves_the_earlier_model_and_no_partial_one(tmp_path):
    final = tmp_path / "final"
    write_whole(str(final), _save("one"))

    def broken(path):
        _save("half")(path)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_whole(str(final), broken)
    assert (final / "config.json").read_text() == "one"
    assert sorted(os.listdir(tmp_path)) == ["final"]
    with pytest.raises(OSError):
        write_whole(str(tmp_path / "fresh"), broken)
    assert not (tmp_path / "fresh").exists() and sorted(os.listdir(tmp_path)) == ["final"]
