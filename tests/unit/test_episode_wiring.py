"""The pieces around a multi-turn run that need no engine: the scripted guess environment's rules and rewards, the
episode metrics the learner computes from a step's groups, and the tool-call counting of the episode worker's
runner (envs/examples.py, metrics/rollout.py, envs/episode_worker.py)."""

from __future__ import annotations

import time

import numpy as np

from asyncppo.envs.episode_worker import CountingRunner, tool_names
from asyncppo.envs.examples import GuessEnv
from asyncppo.metrics.rollout import EngineTotals, episode_metrics
from asyncppo.stream.records import Sample, TrajectoryGroup


def test_guess_env_answers_higher_lower_and_rewards_fewer_turns():
    env = GuessEnv({}, extras={"target": 6})
    messages, _ = env.init([{"role": "user", "content": "07+45="}])
    assert messages == [{"role": "user", "content": "Guess my number, 0 to 9."}]
    assert env.step("3") == ([{"role": "user", "content": "higher"}], 0.0, False, {"solved": False})
    assert env.step("8!") == ([{"role": "user", "content": "lower"}], 0.0, False, {"solved": False})
    assert env.step("no idea")[0] == [{"role": "user", "content": "Say a number."}]
    assert env.step("6") == ([], 0.25, True, {"solved": True})  # 1 - (4 - 1) / 4
    assert GuessEnv({}, extras={"target": 2}).step("2")[1:3] == (1.0, True)
    slow = GuessEnv({"max_guesses": 2}, extras={"target": 2})
    assert slow.step("1")[2] is False and slow.step("1") == ([], 0.0, True, {"solved": False})
    # without a target, the row picks it: the n episodes of a group play the same game
    a, b = (GuessEnv({}, extras={"prompt": "07+45=", "index": 3}) for _ in range(2))
    assert a.target == b.target and 0 <= a.target <= 9


def _sample(length, env_runs=None, turn_rewards=None):
    return Sample(np.zeros(length, np.int32), np.zeros(length, np.float32), 0.0, "stop", 0, 0,
                  env_runs=None if env_runs is None else np.asarray(env_runs, np.int64).reshape(-1, 2),
                  turn_rewards=None if turn_rewards is None else np.asarray(turn_rewards, np.float64))


def test_episode_metrics_by_hand():
    # 3 episodes: 3 turns (env runs of 10 and 8 in 30 tokens), 1 turn (10 tokens), 2 turns (a run of 6 in 20)
    g1 = TrajectoryGroup("a", 0, np.zeros(2, np.int32), [_sample(30, [(4, 10), (18, 8)], [0, 0, 1]),
                                                         _sample(10, None, [0.5])],
                         timings={"env_calls": 4.0, "env_s": 0.2, "tool_calls": 2.0, "tool_errors": 1.0,
                                  "episodes_truncated": 1.0, "env_faults": 3.0, "env_faults_timeout": 2.0,
                                  "env_faults_raised": 1.0})
    g2 = TrajectoryGroup("b", 0, np.zeros(2, np.int32), [_sample(20, [(5, 6)], [0, 1])],
                         timings={"env_calls": 1.0, "env_s": 0.3})
    m = episode_metrics([g1, g2])
    assert m["episodes/turns_mean"] == 2.0 and m["episodes/turns_max"] == 3.0
    assert m["episodes/env_token_frac"] == 24 / 60
    assert m["episodes/env_s_per_step"] == 0.5 / 5
    assert (m["episodes/tool_calls"], m["episodes/tool_errors"], m["episodes/truncated"]) == (2.0, 1.0, 1.0)
    # faults in all and by kind, summed over the groups that carry them
    assert (m["episodes/env_faults"], m["episodes/env_faults_timeout"], m["episodes/env_faults_raised"]) == (3, 2, 1)
    # single-turn groups add no episode metrics, and the step metrics carry them when there are episodes
    single = TrajectoryGroup("c", 0, np.zeros(2, np.int32), [_sample(5)])
    assert episode_metrics([single]) == {}
    assert "episodes/turns_mean" not in EngineTotals(8).add([single])
    assert EngineTotals(8).add([g2])["episodes/turns_mean"] == 2.0


class _ToolEnv:
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]

    def step(self, action_text):
        return [], 0.0, True, {}


def test_counting_runner_counts_tool_calls_and_errors():
    env = _ToolEnv()
    assert tool_names(env) == ["calc"]
    with CountingRunner(max_concurrency=2, step_timeout_s=5.0) as runner:
        runner.step(env, '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>')
        runner.step(env, '<tool_call>{"name": "web", "arguments": {}}</tool_call> <tool_call>oops</tool_call>')
        runner.step(env, "no call at all")
        assert runner.tools.counts == {"calls": 1, "unknown": 1, "malformed": 1}
        assert runner.calls == 3


class _SlowOpenCloseEnv:
    """An environment whose init and close take 60 ms each and whose steps are instant."""

    def init(self, messages):
        time.sleep(0.06)
        return messages, {}

    def step(self, action_text):
        return [], 0.0, False, {}

    def close(self):
        time.sleep(0.06)


def test_runner_times_step_calls_apart_from_init_and_close():
    """episodes/env_s_per_step is a tool's latency, the step calls alone: a slow init and close (60 ms each) are
    in the runner's total seconds and not in its step seconds."""
    env = _SlowOpenCloseEnv()
    with CountingRunner(max_concurrency=2, step_timeout_s=5.0) as runner:
        runner.init(env, [{"role": "user", "content": "hi"}])
        runner.step(env, "a")
        runner.step(env, "b")
        runner.close(env)
        assert runner.calls == 4 and runner.step_calls == 2
        assert runner.seconds - runner.step_seconds >= 0.12  # the sleeps of init and close, never the steps'


def test_launch_refuses_a_tokenizer_without_chat_template_and_a_class_that_does_not_import(tmp_path):
    import pytest

    from asyncppo.config import load_config
    from asyncppo.data.tiny import build_tokenizer
    from asyncppo.envs.chat import build_chat_tokenizer
    from asyncppo.launch.text_env_check import check_text_env_launch

    plain, chat = tmp_path / "plain", tmp_path / "chat"
    build_tokenizer().save_pretrained(plain)
    build_chat_tokenizer().save_pretrained(chat)
    cfg = load_config(["env.text_env=asyncppo.envs.examples.GuessEnv", f"model.path={plain}"])
    with pytest.raises(ValueError, match=r"env.text_env='asyncppo.envs.examples.GuessEnv' needs a tokenizer with a "
                                         r"chat template .* model.path=.*plain.* has none"):
        check_text_env_launch(cfg, str(plain))
    check_text_env_launch(cfg, str(chat))  # accepted
    cfg.env.text_env = "no_such_pkg.Env"
    with pytest.raises(ValueError, match="env.text_env='no_such_pkg.Env': cannot import"):
        check_text_env_launch(cfg, str(chat))
