"""The text-environment layer: chat rendering that only appends, the tool-call parser, the off-loop runner's
faults (raise, hang past the deadline, malformed observation, non-finite reward) and the env options."""

import asyncio
import copy
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from asyncppo.config import load_config
from asyncppo.config.checks import ConfigError
from asyncppo.config.validate import check_config
from asyncppo.envs.chat import IM_END, QWEN_STYLE_TEMPLATE, build_chat_tokenizer, turn_ids, turn_text
from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.text_env import TextEnv, load_text_env
from asyncppo.envs.tools import ToolCall, ToolCallCounter, error_observation, parse_tool_calls, tool_message

CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate a product",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}


class CalcEnv(TextEnv):
    """The docs/environments.md example: a calculator tool, and a reward for the right final answer."""

    tools = [CALC]

    def step(self, action_text):
        parsed = parse_tool_calls(action_text, known_tools={"calc"})
        if parsed.errors:
            return error_observation(parsed.errors), 0.0, False, {"tool_errors": len(parsed.errors)}
        if parsed.calls:
            a, b = parsed.calls[0].arguments["expr"].split("*")
            return [tool_message(str(int(a) * int(b)))], 0.0, False, {}
        return [], float(parsed.text.strip() == str(self.extras["answer"])), True, {}


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def test_appended_turn_ids_equal_a_full_render_of_the_conversation(tok):
    system, user = {"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 123*45?"}
    a1 = '<tool_call>\n{"name": "calc", "arguments": {"expr": "123*45"}}\n</tool_call>'
    a2 = "5535"
    env = CalcEnv(extras={"answer": 5535})
    obs1, _, done, _ = env.step(a1)
    assert obs1 == [{"role": "tool", "content": "5535"}] and not done
    def render_ids(messages, **kw):
        return tok.encode(tok.apply_chat_template(messages, tools=[CALC], tokenize=False, **kw),
                          add_special_tokens=False)

    prompt = render_ids([system, user], add_generation_prompt=True)
    # the engine's ids of each model turn, stop token included; the environment's turn appended as ids
    episode = (list(prompt) + tok.encode(a1 + IM_END, add_special_tokens=False)
               + turn_ids(tok, obs1, tools=[CALC], model_stop_text=IM_END)
               + tok.encode(a2 + IM_END, add_special_tokens=False))
    conversation = [system, user, {"role": "assistant", "content": a1}, *obs1, {"role": "assistant", "content": a2}]
    full = render_ids(conversation)
    assert episode + tok.encode("\n", add_special_tokens=False) == full
    assert tok.unk_token_id not in full
    assert tok.decode(turn_ids(tok, obs1, model_stop_text=IM_END)) == \
        "\n<|im_start|>user\n<tool_response>\n5535\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # an engine that leaves the stop token out: the environment's ids close the assistant turn
    assert turn_text(tok, obs1).startswith(IM_END + "\n<|im_start|>user")
    assert CalcEnv(extras={"answer": 5535}).step(a2)[1:3] == (1.0, True)


def test_a_template_that_rewrites_the_past_or_closes_turns_differently_is_refused():
    counting = build_chat_tokenizer(template="{{ messages | length }}" + QWEN_STYLE_TEMPLATE)
    with pytest.raises(ValueError, match="not prefix-stable"):
        turn_ids(counting, [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match="does not begin with the model's stop text"):
        turn_text(build_chat_tokenizer(), [{"role": "user", "content": "x"}], model_stop_text="</s>")


def test_tool_call_parser():
    p = parse_tool_calls('I will compute. <tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call> '
                         '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"4*5\\"}"}</tool_call>',
                         known_tools={"calc"})
    assert p.calls == [ToolCall("calc", {"expr": "2*3"}), ToolCall("calc", {"expr": "4*5"})]
    assert p.errors == [] and p.text == "I will compute."
    bad = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {</tool_call>'
                           '<tool_call>["calc"]</tool_call><tool_call>{"name": "rm", "arguments": {}}</tool_call>'
                           '<tool_call>{"name": "calc", "arguments": [1]}</tool_call> 42 <tool_call>{"name"',
                           known_tools={"calc"})
    assert bad.calls == [] and len(bad.errors) == 5 and bad.unknown == 1 and bad.text == "42"
    assert [e.split(" (")[0] for e in bad.errors] == ["malformed tool call", "malformed tool call",
                                                       "unknown tool 'rm'; available: ['calc']",
                                                       "malformed tool call", "malformed tool call"]
    counter = ToolCallCounter()
    counter.add(p)
    counter.add(bad)
    assert dict(counter.counts) == {"calls": 2, "malformed": 4, "unknown": 1}
    assert error_observation(["x"]) == [{"role": "tool", "content": "error: x"}]
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"calc"', "[", "]", ",", '"arguments"', "1",
              "\\", '"', "null", "\n"]
    for _ in range(500):  # random tag soup never raises
        parse_tool_calls("".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))), known_tools={"calc"})


class Faulty(TextEnv):
    def __init__(self, how, env_config=None, extras=None):
        super().__init__(env_config, extras)
        self.how = how

    def step(self, action_text):
        if self.how == "raise":
            raise RuntimeError("tool crashed")
        if self.how == "hang":
            time.sleep(3.0)
        if self.how == "malformed":
            return "not a list", 1.0, False, {}
        if self.how == "nan":
            return [], float("nan"), True, {}
        if self.how == "mapping":  # skyrl-gym's BaseTextEnvStepOutput
            return {"observations": [{"role": "user", "content": "ok"}], "reward": 0.5, "done": False,
                    "metadata": {"k": 1}}
        return [{"role": "user", "content": "ok"}], 1.0, True, {}


def test_runner_turns_every_fault_into_a_counted_outcome():
    with EnvRunner(max_concurrency=2, step_timeout_s=0.5, on_error="zero_reward") as runner:
        for how, fault in (("raise", "raised"), ("malformed", "malformed"), ("nan", "nonfinite_reward")):
            out = runner.step(Faulty(how), "x")
            assert (out.fault, out.reward, out.done, out.drop) == (fault, 0.0, True, False), out
            assert "Faulty.step" in out.detail
        t0 = time.monotonic()
        out = runner.step(Faulty("hang"), "x")
        assert out.fault == "timeout" and time.monotonic() - t0 < 2.5 and runner.stuck == 1
        # the other episodes go on while one pool thread is stuck in the hung call
        ok = runner.step(Faulty("ok"), "x")
        assert (ok.fault, ok.reward, ok.done, ok.observations) == (None, 1.0, True, [{"role": "user", "content": "ok"}])
        m = runner.step(Faulty("mapping"), "x")
        assert (m.fault, m.reward, m.done, m.info) == (None, 0.5, False, {"k": 1})
        assert dict(runner.faults) == {"raised": 1, "timeout": 1, "malformed": 1, "nonfinite_reward": 1}
        assert runner.calls == 6
    with EnvRunner(max_concurrency=1, step_timeout_s=1.0, on_error="drop") as runner:
        out = runner.step(Faulty("raise"), "x")
        assert out.drop and out.done and out.fault == "raised"
        bad_init = runner.init(Faulty("ok"), "not messages")
        assert bad_init.fault == "malformed"


def test_runner_bounds_concurrency_and_awaits_coroutine_environments():
    active, peak, lock = [0], [0], threading.Lock()

    class Slow(TextEnv):
        def step(self, action_text):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.05)
            with lock:
                active[0] -= 1
            return [], 1.0, True, {}

    class Awaiting(TextEnv):
        async def step(self, action_text):
            await asyncio.sleep(0.05 if action_text == "fast" else 5.0)
            return [{"role": "tool", "content": action_text}], 1.0, False, {}

    with EnvRunner(max_concurrency=2, step_timeout_s=1.0) as runner:
        plain = [f.result(timeout=30) for f in [runner.start(Slow(), "step", "x") for _ in range(6)]]
        fast, slow = (f.result(timeout=30) for f in [runner.start(Awaiting(), "step", w) for w in ("fast", "slow")])
        assert all(o.fault is None for o in plain) and peak[0] == 2
        assert fast.observations == [{"role": "tool", "content": "fast"}] and slow.fault == "timeout"
        assert runner.step(Awaiting(), "fast").reward == 1.0  # a coroutine step from the blocking path too

        async def awaited():  # an asyncio caller awaits the same futures
            return await asyncio.wait_for(asyncio.wrap_future(runner.start(Awaiting(), "step", "fast")), 30)

        assert asyncio.run(awaited()).observations == [{"role": "tool", "content": "fast"}]


def test_env_options_are_validated_with_the_option_named():
    with pytest.raises(ConfigError, match="env.on_error='retry': unknown value; allowed: drop, zero_reward"):
        load_config(["env.on_error=retry"])
    cfg = load_config([])
    assert cfg.env.on_error == "zero_reward" and cfg.env.text_env is None
    for key, value, words in (("step_timeout_s", 0, "env.step_timeout_s=0: must be > 0"),
                              ("max_concurrency", -1, "env.max_concurrency=-1: must be >= 0"),
                              ("max_turns", -1, "env.max_turns=-1: must be > 0"),
                              ("text_env", "not-a-path", "must be a dotted class path"),
                              ("max_tokens_per_turn", 0, "env.max_tokens_per_turn=0: must be null or > 0"),
                              ("text_env", "my_pkg.envs.MyEnv", None)):
        bad = copy.deepcopy(cfg)
        setattr(bad.env, key, value)
        errors, _ = check_config(bad)
        if words is None:  # a well-formed class path is accepted: the episode worker runs it (launch checks imports)
            assert errors == [], (key, errors)
            continue
        assert len(errors) == 1 and words in errors[0], (key, errors)


def test_load_text_env():
    assert load_text_env(f"{__name__}:CalcEnv") is CalcEnv and load_text_env(f"{__name__}.CalcEnv") is CalcEnv
    with pytest.raises(ValueError, match="env.text_env='no_such_pkg.Env': cannot import"):
        load_text_env("no_such_pkg.Env")
    with pytest.raises(ValueError, match="not a class with init"):
        load_text_env("asyncppo.envs.tools.parse_tool_calls")


def test_a_call_hung_forever_does_not_keep_the_process_from_exiting():
    code = ("import time\nfrom asyncppo.envs.env_runner import EnvRunner\n"
            "class Hang:\n    def step(self, a):\n        time.sleep(3600)\n"
            "r = EnvRunner(1, 0.2)\nprint(r.step(Hang(), 'x').fault)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0 and out.stdout.strip() == "timeout", out.stderr[-2000:]
    assert time.monotonic() - t0 < 30


def test_env_concurrency_auto_is_the_episodes_a_worker_may_hold():
    # (j + 1) x B x n: the staleness window's groups of n episodes
    cfg = load_config(["data=guess", "rollout.max_staleness=4", "rollout.rollout_batch_size=4",
                       "rollout.num_return_sequences_in_group=8"])
    assert cfg.env.max_concurrency == (4 + 1) * 4 * 8
    cfg = load_config(["data=guess", "rollout.max_staleness=4", "rollout.admission_lookahead=1",
                       "rollout.rollout_batch_size=4", "rollout.num_return_sequences_in_group=8"])
    assert cfg.env.max_concurrency == (1 + 1) * 4 * 8
    cfg = load_config(["data=guess", "rollout.max_staleness=8", "rollout.rollout_batch_size=16",
                       "rollout.num_return_sequences_in_group=8"])
    assert cfg.env.max_concurrency == 256  # at most AUTO_ENV_CONCURRENCY_MAX
    assert load_config(["data=guess", "env.max_concurrency=12"]).env.max_concurrency == 12  # set by hand: kept
    # an auto lookahead starts at j = 1 here but may widen to the staleness cap (6): the pool is sized for that
    cfg = load_config(["data=guess", "rollout.max_staleness=auto", "rollout.admission_lookahead=auto",
                       "rollout.max_staleness_cap=6", "rollout.rollout_batch_size=4",
                       "rollout.num_return_sequences_in_group=4"])
    assert cfg.rollout.admission_lookahead == 1 and cfg.env.max_concurrency == (6 + 1) * 4 * 4
    cfg = load_config(["data=guess", "rollout.max_staleness=auto", "rollout.admission_lookahead=1",
                       "rollout.max_staleness_cap=6", "rollout.rollout_batch_size=4",
                       "rollout.num_return_sequences_in_group=4"])  # j pinned: the window it pins
    assert cfg.env.max_concurrency == (1 + 1) * 4 * 4
    cfg = load_config(["data=guess", "rollout.max_staleness=3", "rollout.admission_lookahead=auto",
                       "rollout.max_staleness_cap=6", "rollout.rollout_batch_size=4",
                       "rollout.num_return_sequences_in_group=4"])  # j auto under a pinned k: at most k
    assert cfg.rollout.window_auto == "j" and cfg.env.max_concurrency == (3 + 1) * 4 * 4


def test_the_widest_lookahead_is_what_an_auto_window_may_reach():
    from asyncppo.config.validate_window import widest_lookahead

    base = ["rollout.rollout_batch_size=4", "rollout.max_staleness_cap=16"]
    for overrides, want in ((["rollout.max_staleness=auto", "rollout.admission_lookahead=auto"], 16),  # k,j
                            (["rollout.max_staleness=auto"], 16),  # k=j: j follows k up to the cap
                            (["rollout.max_staleness=5", "rollout.admission_lookahead=auto"], 5),  # j alone: <= k
                            (["rollout.max_staleness=auto", "rollout.admission_lookahead=2"], 2),  # j pinned
                            (["rollout.max_staleness=8", "rollout.admission_lookahead=3"], 3)):  # fixed
        r = load_config([*base, *overrides]).rollout
        assert widest_lookahead(r) == want, (overrides, r.window_auto)
