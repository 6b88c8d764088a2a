"""The calculator task (data=calculator): the tool's safe evaluator, the environment's turns and reward, the split,
and the warm start's transcripts (trained spans = what the model writes in an episode)."""

from __future__ import annotations

import pytest

from asyncppo.data.calculator import (CALC_TOOL, CalculatorTask, evaluate_expression, tool_call_text,
                                      transcript_segments)
from asyncppo.envs.calculator import CalculatorEnv


@pytest.mark.parametrize("expr,value", [("347*86", 29842), ("2+3*4", 14), (" 10 - 2 * 3 ", 4), ("-5+2", -3),
                                        ("7", 7), ("2*3*4-1", 23), ("0-0", 0)])
def test_the_tool_evaluates_digits_and_plus_minus_times(expr, value):
    assert evaluate_expression(expr) == value


@pytest.mark.parametrize("expr,reason", [
    ("__import__('os').system('true')", "unexpected character"), ("2**10", "between two numbers"),
    ("(2+3)", "unexpected character"), ("2/3", "unexpected character"), ("", "empty"), ("3+", "between two"),
    ("3 4 5", "without an operator"), ("3 4", "between two"), ("1" * 13, "more than 12 digits"),
    ("1+" * 40 + "1", "longer than 64"), ("1e5", "unexpected character"), ("1+-+3", "expected a number")])
def test_the_tool_refuses_anything_else_with_the_reason(expr, reason):
    with pytest.raises(ValueError, match=reason):
        evaluate_expression(expr)
    with pytest.raises(ValueError, match="must be a string"):
        evaluate_expression(42)


def _env(answer="29842", max_turns=3):
    return CalculatorEnv({}, {"prompt": "What is 347*86?", "answer": answer, "index": 0, "max_turns": max_turns})


def test_a_call_is_answered_as_a_tool_turn_and_the_right_answer_earns_1():
    env = _env()
    obs, reward, done, _ = env.step(tool_call_text("347*86"))
    assert obs == [{"role": "tool", "content": "29842"}] and reward == 0.0 and not done
    assert env.step(" 29842 ") == ([], 1.0, True, {"solved": True})
    assert env.tool_calls == 1


def test_a_wrong_answer_earns_0_and_ends_the_episode():
    assert _env().step("29843")[1:3] == (0.0, True)
    assert _env().step("")[1:3] == (0.0, True)


def test_malformed_calls_and_bad_expressions_become_error_observations_never_exceptions():
    env = _env(max_turns=6)
    obs, reward, done, _ = env.step('<tool_call>{"name": "calc", "arguments": {"expr": "347*86"}')  # unclosed
    assert obs[0]["role"] == "tool" and obs[0]["content"].startswith("error: malformed tool call") and not done
    obs, *_ = env.step('<tool_call>{"name": "calc" "arguments"}</tool_call>')
    assert obs[0]["content"].startswith("error: malformed tool call (not JSON")
    obs, *_ = env.step('<tool_call>{"name": "exec", "arguments": {"expr": "1"}}</tool_call>')
    assert obs[0]["content"].startswith("error: unknown tool 'exec'")
    obs, *_ = env.step(tool_call_text("open('x')"))
    assert obs == [{"role": "tool", "content": "error: unexpected character 'o': only digits and + - * are allowed"}]
    obs, reward, done, _ = env.step('<tool_call>{"name": "calc", "arguments": {}}</tool_call>')  # no expr
    assert obs == [{"role": "tool", "content": "error: expr must be a string, got NoneType"}] and not done
    assert env.step("<tool_call>[1]</tool_call>")[:3] == ([], 0.0, True)  # the 6th turn: the limit, unsolved


def test_a_call_at_the_turn_limit_ends_the_episode_unsolved():
    env = _env(max_turns=1)
    assert env.step(tool_call_text("347*86")) == ([], 0.0, True, {"solved": False, "tool_calls": 1})


def test_a_skyrl_row_gives_its_ground_truth():
    env = CalculatorEnv({}, {"reward_spec": {"ground_truth": 12}})
    assert env.step("12")[1] == 1.0
    with pytest.raises(ValueError, match="ground_truth"):
        CalculatorEnv({}, {})


def test_held_out_pool_is_disjoint_from_train_whatever_num_eval():
    for num_eval in (0, 16, 256):
        task = CalculatorTask(seed=0, num_eval=num_eval)
        splits = task.splits()
        pool = {r["prompt"] for r in task.held_out()}
        assert len(pool) == CalculatorTask.HELD_OUT_POOL and not pool & {r["prompt"] for r in splits.train}
        assert len(splits.eval) == num_eval and len(splits.train) == 900 * 90 - CalculatorTask.HELD_OUT_POOL
    row = CalculatorTask().held_out()[0]
    a, b = row["expr"].split("*")
    assert 100 <= int(a) <= 999 and 10 <= int(b) <= 99 and row["answer"] == str(int(a) * int(b))
    assert row["prompt"] == f"What is {a}*{b}?"
    with pytest.raises(ValueError, match="num_eval"):
        CalculatorTask(num_eval=5000)


def test_transcripts_train_exactly_the_assistant_turns_of_the_full_render():
    from asyncppo.data.chat_tokenizer import TINY_TOOLS_TEMPLATE, build_chat_tokenizer

    tok = build_chat_tokenizer(template=TINY_TOOLS_TEMPLATE)
    task = CalculatorTask()
    row = task.splits().train[0]
    for use_tool in (True, False):
        messages = task.transcript_messages(row, use_tool)
        segments = transcript_segments(tok, messages, [CALC_TOOL])
        full = tok.apply_chat_template(messages, tools=[CALC_TOOL], tokenize=False)
        assert full == "".join(t for t, _ in segments) + "\n"  # the template's closing newline is not generated
        trained = [t for t, on in segments if on]
        expected = [tool_call_text(row["expr"]), row["answer"]] if use_tool else [row["answer"]]
        assert trained == [t + "<|im_end|>" for t in expected]
        assert '"name": "calc"' in segments[0][0]  # the tool's schema is rendered in the system turn


def test_encoded_transcripts_mask_exactly_the_trained_segments_and_the_shape_is_the_built_models():
    from asyncppo.data.chat_tokenizer import TINY_TOOLS_TEMPLATE, build_chat_tokenizer
    from asyncppo.data.transcript_warmstart import encode_transcripts
    from asyncppo.launch.shared_device import model_shape

    tok = build_chat_tokenizer(template=TINY_TOOLS_TEMPLATE)
    segments = [[("<|im_start|>user\nab", False), ("12<|im_end|>", True), ("\nxy", False), ("7<|im_end|>", True)],
                [("q", False), ("3<|im_end|>", True)]]
    ids, attn, mask = encode_transcripts(tok, segments)
    assert ids.shape == (2, 16) and attn.sum(-1).tolist() == [16, 3]  # <|im_start|> is one token, "user" four
    assert mask[0].tolist() == [0] * 8 + [1] * 3 + [0] * 3 + [1] * 2 and mask[1].tolist() == [0, 1, 1] + [0] * 13
    assert tok.decode(ids[0][mask[0].bool()]) == "12<|im_end|>7<|im_end|>"
    assert model_shape("builtin:tiny-calculator").vocab == len(tok)  # the chat specials counted
