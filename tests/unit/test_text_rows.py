"""Dataset rows in SkyRL's format (data/text_rows.py) and the constructor call (envs/text_env.py: make_text_env).

Rows as skyrl-train reads them: the prompt (chat messages) goes to ``init``, every other field but ``env_class``
reaches the environment's constructor as ``extras``, with ``max_turns`` set to the run's; bad rows are skipped,
counted and named by file and line.
"""

from __future__ import annotations

import json

import pytest

from asyncppo.data.datasets import DatasetStats
from asyncppo.data.text_rows import build_text_env_rows, read_text_env_rows
from asyncppo.envs.text_env import TextEnv, make_text_env

PROMPT = [{"role": "system", "content": "Answer as '#### N'."}, {"role": "user", "content": "What is 8*9?"}]
GOOD = {"data_source": "local/arith", "prompt": PROMPT, "env_class": "gsm8k_multi_turn",
        "reward_spec": {"method": "rule", "ground_truth": "72"}, "extra_info": {"split": "train", "index": 7}}


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_rows_carry_prompt_messages_and_extras(tmp_path):
    rows = read_text_env_rows([_write_jsonl(tmp_path / "rows.jsonl", [GOOD, dict(GOOD, env_class=None)])])
    assert len(rows) == 2 and [r.index for r in rows] == [0, 1]
    r = rows[0]
    assert r.prompt_messages == PROMPT and r.env_class == "gsm8k_multi_turn" and rows[1].env_class is None
    assert r.extras == {"data_source": "local/arith", "reward_spec": {"method": "rule", "ground_truth": "72"},
                        "extra_info": {"split": "train", "index": 7}}
    assert r.source.endswith("rows.jsonl:1")
    copy = r.episode_extras()
    copy["reward_spec"]["ground_truth"] = "changed by an environment"
    assert r.extras["reward_spec"]["ground_truth"] == "72"  # each episode edits its own copy


def test_parquet_rows_with_nested_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "rows.parquet")
    pq.write_table(pa.Table.from_pylist([GOOD, dict(GOOD, reward_spec={"method": "rule", "ground_truth": "5"})]),
                   path)
    rows = read_text_env_rows([path])
    assert [r.extras["reward_spec"]["ground_truth"] for r in rows] == ["72", "5"]
    assert rows[0].prompt_messages == PROMPT and rows[0].extras["extra_info"] == {"split": "train", "index": 7}


@pytest.mark.parametrize("row, reason", [
    ("{not json", "invalid JSON"),
    ([1, 2], "expected an object, got list"),
    ({"reward_spec": {}}, "missing key 'prompt'"),
    (dict(GOOD, prompt="What is 8*9?"), "key 'prompt' must be a non-empty list of chat messages"),
    (dict(GOOD, prompt=[]), "key 'prompt' must be a non-empty list"),
    (dict(GOOD, prompt=[{"role": "user"}]), "prompt[0] must be an object with string 'role' and 'content'"),
    (dict(GOOD, prompt=[{"role": "user", "content": 3}]), "prompt[0] must be an object"),
    (dict(GOOD, env_class=3), "key 'env_class' must be a string"),
    (dict(GOOD, reward_spec="72"), "key 'reward_spec' must be an object, got str"),
    (dict(GOOD, extra_info=[1]), "key 'extra_info' must be an object, got list"),
])
def test_bad_rows_are_skipped_counted_and_named(tmp_path, row, reason):
    path = _write_jsonl(tmp_path / "rows.jsonl", [GOOD, row, GOOD])
    stats = DatasetStats()
    rows = read_text_env_rows([path], stats=stats)
    assert len(rows) == 2 and stats.rows_read == 3 and stats.bad_rows == 1
    assert stats.bad_examples[0].startswith(f"{path}:2: ") and reason in stats.bad_examples[0]


def test_no_usable_row_is_an_error_naming_the_file(tmp_path):
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a string"}])
    with pytest.raises(ValueError, match=r"no usable row in .*rows\.jsonl.*1 read, 1 bad"):
        read_text_env_rows([path])
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_text_env_rows([str(tmp_path / "missing.jsonl")])


def test_rows_from_the_config(tmp_path):
    from asyncppo.config import load_config

    train = _write_jsonl(tmp_path / "train.jsonl", [GOOD])
    with pytest.warns(UserWarning, match="built-in synthetic-task model"):  # the tiny model: not this test's point
        cfg = load_config(overrides=[f"data.train_files=[{train}]", "+env.text_env_config.timeout=5"])
    assert build_text_env_rows(cfg)[0].extras["reward_spec"]["ground_truth"] == "72"
    assert cfg.env.text_env_config == {"timeout": 5}
    with pytest.raises(ValueError, match="data.eval_files is empty"):
        build_text_env_rows(cfg, "eval")


class KeepsWhatItGets(TextEnv):
    def step(self, action_text):
        return [], 0.0, True, {}


class TakesNoArguments(TextEnv):
    def __init__(self):
        super().__init__()


def test_make_text_env_passes_config_and_extras_as_skyrl_train_does(tmp_path):
    [row] = read_text_env_rows([_write_jsonl(tmp_path / "rows.jsonl", [dict(GOOD, max_turns=9)])])
    env = make_text_env(KeepsWhatItGets, row.episode_extras(), {"timeout": 5}, max_turns=3)
    assert env.extras == dict(row.extras, max_turns=3)  # the run's max_turns wins over the row's, as in skyrl-train
    assert env.env_config == {"timeout": 5}
    with pytest.raises(ValueError, match=r"env.text_env='test_text_rows.TakesNoArguments': constructing it"):
        make_text_env(TakesNoArguments, row.episode_extras())


def _find_the_number_class():
    """The example of docs/environments.md ("Bring your own environment"), as written there."""
    skyrl = pytest.importorskip("skyrl_gym.envs.base_text_env", reason="skyrl-gym is the optional extra asyncppo[envs]")

    def last_number(text):
        tail = text.rsplit("####", 1)[-1].strip().split()
        return int(tail[0]) if tail and tail[0].lstrip("-").isdigit() else None

    class FindTheNumber(skyrl.BaseTextEnv):
        def __init__(self, env_config=None, extras=None):
            super().__init__()
            self.answer = int(extras["reward_spec"]["ground_truth"])  # the dataset row's fields arrive as extras
            self.max_turns = extras["max_turns"]                       # set to the run's env.max_turns
            self.partial = float((env_config or {}).get("partial", 0.0))  # +env.text_env_config.partial=0.1

        def step(self, action):
            self.turns += 1
            guess = last_number(action)
            if guess == self.answer:
                return {"observations": [], "reward": 1.0, "done": True, "metadata": {}}
            if guess is None or self.turns >= self.max_turns:
                return {"observations": [], "reward": 0.0, "done": True, "metadata": {}}
            hint = "too high" if guess > self.answer else "too low"
            return {"observations": [{"role": "user", "content": f"{hint}; answer again as '#### N'"}],
                    "reward": self.partial, "done": False, "metadata": {}}

    return FindTheNumber


def test_the_documented_environment_runs_through_the_runner(tmp_path):
    from asyncppo.envs.env_runner import EnvRunner

    row = dict(GOOD, reward_spec={"method": "rule", "ground_truth": "37"})
    [r] = read_text_env_rows([_write_jsonl(tmp_path / "rows.jsonl", [row])])
    env = make_text_env(_find_the_number_class(), r.episode_extras(), {"partial": 0.1}, max_turns=3)
    with EnvRunner(max_concurrency=1, step_timeout_s=30) as runner:
        assert runner.init(env, r.prompt_messages).observations == PROMPT
        high, low, right = (runner.step(env, f"I think #### {n}") for n in (50, 20, 37))
    assert high.fault is None and high.reward == 0.1 and not high.done
    assert high.observations == [{"role": "user", "content": "too high; answer again as '#### N'"}]
    assert low.observations[0]["content"].startswith("too low") and (right.reward, right.done) == (1.0, True)
    env = make_text_env(type(env), r.episode_extras(), max_turns=1)
    out = env.step("#### 12")
    assert (out["reward"], out["done"]) == (0.0, True)  # wrong, and out of tries
