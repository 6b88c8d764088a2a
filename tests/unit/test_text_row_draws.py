"""SkyRL-format rows drawn in the run's prompt order: shards, per-epoch shuffle, resume positions and the format
check that picks them (data/text_row_draws.py)."""

from __future__ import annotations

import json

import pytest

from asyncppo.data.datasets import PromptDataset
from asyncppo.data.position import resume_draws
from asyncppo.data.text_row_draws import TextRowDataset, text_env_rows_in


def _skyrl_rows(path, n: int, bad_at: int | None = None):
    lines = []
    for i in range(n):
        row = {"prompt": [{"role": "user", "content": f"question {i}"}], "env_class": "gsm8k",
               "reward_spec": {"method": "rule", "ground_truth": str(i)}, "extra_info": {"i": i}}
        lines.append(json.dumps(row))
        if bad_at == i:
            lines.append(json.dumps({"prompt": "a text prompt"}))  # not a list of chat messages
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _truths(rows) -> list[int]:
    return [int(r.extras["reward_spec"]["ground_truth"]) for r in rows]


def test_rows_draw_in_the_prompt_order_and_shard_alike(tmp_path):
    f = _skyrl_rows(tmp_path / "rows.jsonl", 7, bad_at=2)
    ds = TextRowDataset.from_files([f])
    assert len(ds) == 7 and ds.stats.bad_rows == 1 and ds.stats.rows_read == 8
    assert "rows.jsonl:4" in ds.stats.bad_examples[0]  # file and line of the skipped row
    # the same order a prompt dataset of as many rows draws (same seed, same shuffle per epoch)
    prompts = PromptDataset([{"prompt": str(i), "answer": str(i)} for i in range(7)], _CharTokenizer())
    for shard in range(2):
        rows_it = ds.shard(shard, 2).iterate(seed=5, shuffle=True)
        prompt_it = prompts.shard(shard, 2).iterate(seed=5, shuffle=True)
        drawn = [next(rows_it) for _ in range(12)]
        assert _truths(drawn) == [p.index for p in (next(prompt_it) for _ in range(12))]
        assert set(_truths(drawn)) == set(range(shard, 7, 2))  # disjoint shards covering the rows
    unshuffled = ds.iterate(shuffle=False)
    assert _truths(next(unshuffled) for _ in range(9)) == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_resume_position_redraws_exactly_the_untrained_rows(tmp_path):
    ds = TextRowDataset.from_files([_skyrl_rows(tmp_path / "rows.jsonl", 5)])
    full = [(seq, r.index) for seq, r in zip(range(10), (r for _, r in resume_draws(ds.iterate(seed=1))))]
    resumed = resume_draws(ds.iterate(seed=1), {"next": 3, "done": [4, 6]})
    again = [(seq, r.index) for seq, r in (next(resumed) for _ in range(5))]
    assert again == [p for p in full if p[0] >= 3 and p[0] not in (4, 6)][:5]
    # every environment gets a private copy of the row's extras
    row = ds[0]
    mine = row.episode_extras()
    mine["reward_spec"]["ground_truth"] = "changed"
    assert row.episode_extras()["reward_spec"]["ground_truth"] == "0"


def test_format_check_tells_skyrl_rows_from_text_rows(tmp_path):
    skyrl = _skyrl_rows(tmp_path / "a.jsonl", 2)
    text = tmp_path / "b.jsonl"
    text.write_text(json.dumps({"prompt": "1+1", "answer": "2"}) + "\n")
    assert text_env_rows_in([skyrl]) and not text_env_rows_in([str(text)]) and not text_env_rows_in([])
    with pytest.raises(ValueError, match=r"data.eval_files: .*a.jsonl.* hold SkyRL-format rows .*b.jsonl"):
        text_env_rows_in([skyrl, str(text)], option="data.eval_files")


class _CharTokenizer:
    """Encodes text as its characters' code points (the prompt dataset needs a tokenizer; the order ignores it)."""

    chat_template = None

    def encode(self, text: str, **_):
        return [ord(c) for c in text]


def test_launch_check_refuses_rows_a_run_cannot_draw(tmp_path):
    from asyncppo.config import load_config
    from asyncppo.envs.chat import build_chat_tokenizer
    from asyncppo.launch.text_env_check import check_text_env_launch

    chat = tmp_path / "chat"
    build_chat_tokenizer().save_pretrained(chat)
    skyrl = _skyrl_rows(tmp_path / "a.jsonl", 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")  # a chat prompt without content
    base = ["env.text_env=asyncppo.envs.examples.GuessEnv", f"model.path={chat}"]
    check_text_env_launch(load_config([*base, f"data.train_files=[{skyrl}]"]), str(chat))  # accepted
    # SkyRL-format eval files are evaluated as episodes (rollout/evaluation.py): accepted, and checked for rows
    check_text_env_launch(load_config([*base, f"data.train_files=[{skyrl}]", f"data.eval_files=[{skyrl}]"]),
                          str(chat))
    with pytest.raises(ValueError, match=r"no usable row in .*bad.jsonl"):
        check_text_env_launch(load_config([*base, f"data.train_files=[{skyrl}]", f"data.eval_files=[{bad}]"]),
                              str(chat))
    with pytest.raises(ValueError, match=r"no usable row in .*bad.jsonl"):
        check_text_env_launch(load_config([*base, f"data.train_files=[{bad}]"]), str(chat))


def test_skyrl_eval_files_are_evaluated_as_episodes_scored_by_their_environment(tmp_path):
    """SkyRL-format ``data.eval_files`` of a text-environment run: an evaluation set of episodes; each row's groups
    (one greedy, ``data.eval_samples`` sampled) start through the worker's ``start_episodes`` with the row itself;
    an answer scores its episode's reward (the sum of its turn rewards) and a group a faulty environment dropped
    scores 0 for each of its answers. The same rows without ``env.text_env`` are refused by name."""
    import numpy as np

    from asyncppo.config import load_config
    from asyncppo.data.heldout import eval_file_sets
    from asyncppo.envs.episodes import EpisodeCompletion, EpisodeGroup
    from asyncppo.rollout.evaluation import EvalRunner

    rows = _skyrl_rows(tmp_path / "held.jsonl", 2)
    base = [f"data.eval_files=[{rows}]", "data.eval_samples=2", "rollout.max_num_seqs=64"]
    with pytest.raises(ValueError, match=r"data.eval_files=.*held.jsonl.*set env.text_env"):
        eval_file_sets(load_config(base), None, 0, 1)
    cfg = load_config([*base, "env.text_env=asyncppo.envs.examples.GuessEnv"])
    sets = eval_file_sets(cfg, None, 0, 1)
    assert list(sets) == ["held.jsonl"] and sets["held.jsonl"].episodes and len(sets["held.jsonl"].dataset) == 2
    runner = EvalRunner(cfg, sets, 0, decode=None, reward_fn=None, score=None, resumed=False)
    started = []
    runner.start_episodes = lambda key, row, spec: started.append((key, row, spec))
    assert runner.on_version(0, loaded=True) is None
    runner.admit(engine=None)  # episodes only: nothing goes to the engine directly
    assert [(k.rsplit(":", 1)[-1], _truths([r])[0], s.n, s.temperature) for k, r, s in started] == [
        ("g", 0, 1, 0.0), ("g", 1, 1, 0.0), ("s", 0, 2, 1.0), ("s", 1, 2, 1.0)]

    def episode(*turn_rewards):
        return EpisodeCompletion(token_ids=np.zeros(3, np.int32), logprobs=np.zeros(3, np.float32),
                                 finish_reason="stop", turn_rewards=np.asarray(turn_rewards, np.float64))

    finished = [EpisodeGroup(started[0][0], [episode(0.0, 0.75)]),  # row 0 greedy: 0.75
                EpisodeGroup(started[1][0], [], dropped=True, detail="init raised"),  # row 1 greedy: 0
                EpisodeGroup(started[2][0], [episode(1.0), episode(0.0, 0.0)]),  # row 0 sampled: 1, 0
                EpisodeGroup(started[3][0], [episode(0.25), episode(0.5)])]  # row 1 sampled
    reports = [runner.finished(g) for g in finished]
    assert reports[:3] == [None, None, None] and not runner.active
    scores = reports[3].files["held.jsonl"]
    assert (scores.prompts, scores.sampled, scores.answers) == (2, 4, 6)
    assert scores.metrics()["accuracy_greedy"] == 0.75 / 2 and scores.metrics()["accuracy_sampled"] == 1.75 / 4
