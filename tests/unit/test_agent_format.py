"""The endpoint's pure parts (agents/openai_format.py, agents/session.py, agents/episode.py's reward rule): what a
request may carry, how a reply is built from the model's text, which calls extend a session, and the reward forms."""

from __future__ import annotations

import asyncio
import json

import pytest

from asyncppo.agents.episode import agent_reward
from asyncppo.agents.openai_format import (Reply, RequestError, completion_body, make_reply, normalize_message,
                                           parse_completion_request, text_completion_body,
                                           parse_chat_request)
from asyncppo.agents.session import Session
from asyncppo.config import ConfigError, load_config
from asyncppo.envs.text_env import MalformedStep

TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
STOPS = {"\n": 5, ";": 9}


def parse(body):
    return parse_chat_request(body, stop_token_id=STOPS.get)


def _status(body) -> tuple[int, str]:
    with pytest.raises(RequestError) as e:
        parse(body)
    return e.value.status, e.value.reason


MSGS = [{"role": "user", "content": "hi"}]


def test_a_plain_request_and_its_limits():
    r = parse({"model": "x", "messages": MSGS, "max_tokens": 30, "max_completion_tokens": 20, "stop": ["\n", ";"],
               "logprobs": True, "temperature": 0.7, "seed": 3, "tools": TOOLS, "tool_choice": "auto",
               "parallel_tool_calls": False, "store": False, "metadata": {"a": "b"}})
    assert r.max_tokens == 20 and r.stop == [5, 9] and r.logprobs and r.tools == TOOLS and r.parse_tools
    assert r.sampling == {"temperature": 0.7, "seed": 3}
    assert parse({"messages": MSGS, "stop": "\n", "tool_choice": "none"}).stop == [5]
    assert not parse({"messages": MSGS, "tool_choice": "none"}).parse_tools


@pytest.mark.parametrize("body, status, named", [
    ({"messages": MSGS, "stream": "yes"}, 400, "stream"),
    ({"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": MSGS, "stream": True, "stream_options": {"bogus": True}}, 400, "stream_options"),
    ({"messages": MSGS, "n": 2}, 400, "n=2"),
    ({"messages": MSGS, "top_logprobs": 5}, 400, "top_logprobs"),
    ({"messages": MSGS, "stop": "END"}, 400, "stop='END'"),
    ({"messages": MSGS, "stop": ["\n"] * 5}, 400, "stop"),
    ({"messages": MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": MSGS, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": MSGS, "max_tokens": True}, 400, "max_tokens"),
    ({"messages": MSGS, "temperature": float("nan")}, 400, "temperature"),
    ({"messages": MSGS, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"messages": MSGS, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"messages": MSGS, "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"messages": MSGS, "functions": []}, 400, "'functions'"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400, "content[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ([1, 2], 400, "JSON object"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(body, status, named):
    got, reason = _status(body)
    assert got == status and named in reason, reason


def test_messages_are_normalized_to_text():
    m = normalize_message({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          0)
    assert m == {"role": "user", "content": "ab"}
    assert normalize_message({"role": "developer", "content": "s"}, 0)["role"] == "system"
    a = normalize_message({"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {}}]}, 1)
    assert a == {"role": "assistant", "content": "", "tool_call_ids": ("c1",), "tool_calls": []}
    assert normalize_message({"role": "tool", "content": "4", "tool_call_id": "c1"}, 2)["tool_call_id"] == "c1"


def test_reply_reads_tool_calls_of_declared_tools_only():
    r = parse({"messages": MSGS, "tools": TOOLS})
    text = 'let me see <tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call>'
    reply = make_reply(text, "stop", r, "chatcmpl-x-1")
    assert reply.content == "let me see" and reply.finish_reason == "tool_calls"
    (call,) = reply.tool_calls
    assert call["id"] == "chatcmpl-x-1-0" and call["function"]["name"] == "calc"
    assert json.loads(call["function"]["arguments"]) == {"expr": "2*3"}
    # an undeclared tool, tool_choice none, or no tools: the text as it is
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert make_reply(unknown, "stop", r, "c").tool_calls == []
    assert make_reply(text, "stop", parse({"messages": MSGS, "tools": TOOLS, "tool_choice": "none"}), "c").content \
        == text
    assert make_reply(text, "length", parse({"messages": MSGS}), "c").finish_reason == "length"
    body = completion_body(reply, call_id="c", model="m", created=1, prompt_tokens=10, token_ids=[1, 2, 3],
                           logprobs=[-0.5, -1.0, -2.0], token_texts=["a", "b", "c"], versions=[4, 4, 5])
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert [x["logprob"] for x in body["choices"][0]["logprobs"]["content"]] == [-0.5, -1.0, -2.0]
    assert body["asyncppo"] == {"token_ids": [1, 2, 3], "versions": [4, 4, 5]}


def _session(branches: str = "final"):
    loop = asyncio.new_event_loop()
    return Session("s", loop, branches), loop


def test_a_session_admits_extensions_and_refuses_rewrites():
    s, loop = _session("refuse")
    first = parse({"messages": MSGS, "tools": TOOLS})
    call = s.accept(first, loop.create_future())
    assert call.new_messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(RequestError) as busy:
        s.accept(first, loop.create_future())
    assert busy.value.status == 409 and busy.value.kind == "concurrent_call"
    reply = make_reply('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>', "stop", first, "c")
    s.reply(reply, {"ok": 1})
    loop.run_until_complete(asyncio.sleep(0))
    assert call.future.result() == {"ok": 1}
    echoed = {"role": "assistant", "content": None, "tool_calls": [{"id": "c-0", "function": {}}]}
    tool = {"role": "tool", "content": "1", "tool_call_id": "c-0"}
    nxt = s.accept(parse({"messages": MSGS + [echoed, tool], "tools": TOOLS}), loop.create_future())
    assert nxt.new_messages == [{"role": "tool", "content": "1", "tool_call_id": "c-0"}]
    s.reply(make_reply("42", "stop", first, "d"), {})
    ok = MSGS + [echoed, tool, {"role": "assistant", "content": " 42 "}]
    for bad in ([{"role": "user", "content": "HI"}] + ok[1:],  # an earlier message edited
                ok[:2],  # a shorter history (truncated context)
                MSGS + [{**echoed, "tool_calls": [{"id": "other"}]}] + ok[2:],  # a reply that is not the model's
                ok + [{"role": "assistant", "content": "prefill"}]):  # an assistant turn the model did not write
        with pytest.raises(RequestError) as e:
            s.accept(parse({"messages": bad, "tools": TOOLS}), loop.create_future())
        assert e.value.status == 409 and e.value.kind == "history_rewritten"
    with pytest.raises(RequestError) as tools:
        s.accept(parse({"messages": ok + [{"role": "user", "content": "x"}]}), loop.create_future())
    assert "tools" in tools.value.reason
    s.accept(parse({"messages": ok + [{"role": "user", "content": "x"}], "tools": TOOLS}), loop.create_future())
    pending = s.pending
    s.close("max_turns")
    loop.run_until_complete(asyncio.sleep(0))
    assert isinstance(pending.future.exception(), RequestError) and pending.future.exception().status == 410
    with pytest.raises(RequestError) as gone:
        s.accept(first, loop.create_future())
    assert gone.value.status == 410 and "max_turns" in gone.value.reason
    assert [m["role"] for m in s.transcript()] == ["user", "assistant", "tool", "assistant", "user"]
    loop.close()


def test_a_rewrite_starts_a_branch_that_keeps_the_first_messages():
    """``env.agent_branches=final``: an agent that summarises its context starts a new branch (the rewritten
    conversation after the first messages is what the episode renders; the trained turns start over), a branch goes
    on by extension like any conversation, and rewrites a branch cannot carry are refused by name."""
    s, loop = _session()
    sys_user = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    c1 = s.accept(parse({"messages": sys_user, "tools": TOOLS}), loop.create_future())
    s.reply(make_reply('<tool_call>{"name": "calc", "arguments": {"expr": "1"}}</tool_call>', "stop", c1.request,
                       "c"), {"asyncppo": {"token_ids": [1, 2]}})
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c-0", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "1"}'}}]}
    tool = {"role": "tool", "content": "1", "tool_call_id": "c-0"}
    c2 = s.accept(parse({"messages": sys_user + [echoed, tool], "tools": TOOLS}), loop.create_future())
    assert not c2.branch and c2.new_messages == [{"role": "tool", "content": "1", "tool_call_id": "c-0"}]
    s.reply(make_reply("it is 1", "stop", c2.request, "d"), {"asyncppo": {"token_ids": [3]}})
    assert s.replied == [[1, 2], [3]] and s.branches == 0
    # the agent replaces the tool exchange by a note of its own: a branch, rendered after the first messages
    summary = sys_user + [{"role": "assistant", "content": "(calc(1) = 1)"}, {"role": "user", "content": "now 2?"}]
    c3 = s.accept(parse({"messages": summary, "tools": TOOLS}), loop.create_future())
    assert c3.branch and [(m["role"], m["content"]) for m in c3.new_messages] == [
        ("assistant", "(calc(1) = 1)"), ("user", "now 2?")]
    assert s.branches == 1 and s.replied == []
    s.reply(make_reply("2", "stop", c3.request, "e"), {"asyncppo": {"token_ids": [4]}})
    c4 = s.accept(parse({"messages": summary + [{"role": "assistant", "content": "2"}, {"role": "user",
                                                                                        "content": "ok"}],
                         "tools": TOOLS}), loop.create_future())
    assert not c4.branch and c4.new_messages == [{"role": "user", "content": "ok"}] and s.replied == [[4]]
    s.reply(make_reply("ok", "stop", c4.request, "f"), {"asyncppo": {"token_ids": [5]}})
    # an assistant message the model did not write, appended: a branch too (the call's calls keep their arguments)
    c5 = s.accept(parse({"messages": sys_user + [echoed], "tools": TOOLS}), loop.create_future())
    assert c5.branch and c5.new_messages[0]["tool_calls"] == [
        {"type": "function", "function": {"name": "calc", "arguments": {"expr": "1"}}}] and s.branches == 2
    s.reply(make_reply("x", "stop", c5.request, "g"), {})
    for bad, says in ((sys_user[:1] + [{"role": "user", "content": "HI"}], "first 2 message(s) unchanged"),
                      (sys_user + [{"role": "user", "content": "again"}], "with an assistant message (got 'user')")):
        with pytest.raises(RequestError) as e:
            s.accept(parse({"messages": bad, "tools": TOOLS}), loop.create_future())
        assert e.value.status == 409 and e.value.kind == "history_rewritten" and says in e.value.reason
    with pytest.raises(RequestError) as tools:
        s.accept(parse({"messages": sys_user}), loop.create_future())
    assert "tools" in tools.value.reason and s.branches == 2
    loop.close()


def test_a_group_may_carry_an_agents_kept_branches():
    """The door's bound on a group's samples: ``n``, and under ``env.agent_branches=all`` each episode's earlier
    branches too (one per model call at most)."""
    from asyncppo.config.checks import samples_per_group

    base = ["data=calculator_agent", "rollout.num_return_sequences_in_group=4", "env.max_turns=3"]
    assert samples_per_group(load_config(overrides=base)) == 4
    assert samples_per_group(load_config(overrides=[*base, "env.agent_branches=all"])) == 12
    assert samples_per_group(load_config(overrides=["data=calculator", "env.agent_branches=all"])) == \
        load_config(overrides=["data=calculator"]).rollout.num_return_sequences_in_group  # no agent, no branches


def test_kept_branches_are_samples_paid_the_episodes_reward():
    """``EpisodeState.restart(keep=True)`` sets the branch aside as a finished sample (ended ``branch``, its own ids,
    masks and versions); the ended episode's samples are its kept branches, each paid the final branch's reward at
    its last turn, then the final branch. ``keep=False`` drops it and returns its model tokens."""
    import numpy as np

    from asyncppo.envs.episode_state import EpisodeState, completions_of
    from asyncppo.rollout.engine import SamplingSpec

    ep = EpisodeState("g", 0, None, [1, 2], SamplingSpec(n=1, max_tokens=8))
    ep.ids, ep.logprobs, ep.versions, ep.turn_rewards = [5, 6], [-0.5, -0.25], [3, 3], [0.0]
    ep.append_env([7])
    ep.ids, ep.logprobs, ep.versions, ep.turn_rewards = ep.ids + [8], ep.logprobs + [-1.0], ep.versions + [4], [0.0, 0.0]
    assert ep.restart(keep=True) == 3 and ep.ids == [] and ep.dropped_turns == 2
    ep.append_env([9, 9])  # the new branch's opening takes the last version held
    ep.ids, ep.logprobs, ep.versions, ep.turn_rewards = ep.ids + [10], ep.logprobs + [-2.0], ep.versions + [5], [0.75]
    assert ep.versions == [4, 4, 5] and ep.turn_number == 3
    old, final = completions_of(ep)
    assert old.ended == "branch" and list(old.token_ids) == [5, 6, 7, 8] and old.env_runs.tolist() == [[2, 1]]
    assert list(old.versions) == [3, 3, 3, 4] and np.allclose(old.logprobs, [-0.5, -0.25, 0.0, -1.0])
    assert list(old.turn_rewards) == [0.0, 0.75] and final.reward == old.reward == 0.75
    assert list(final.token_ids) == [9, 9, 10] and final.env_runs.tolist() == [[0, 2]]
    assert ep.restart(keep=False) == 1 and len(ep.earlier) == 1  # dropped: one model token


def test_a_branch_renders_after_the_prompt_exactly():
    """The text a branch appends is the full rendering less the prompt's: with the assistant header the prompt ends
    in opening the rewritten conversation's first message; nothing when the agent starts over; refused otherwise."""
    from asyncppo.envs.chat import branch_text, build_chat_tokenizer

    tok = build_chat_tokenizer()
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    rest = [{"role": "assistant", "content": "note"}, {"role": "user", "content": "go"}]
    assert branch_text(tok, first, rest) == "note<|im_end|>\n<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n"
    assert branch_text(tok, first, []) == ""
    prompt = tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True)
    assert prompt + branch_text(tok, first, rest) == tok.apply_chat_template(first + rest, tokenize=False,
                                                                              add_generation_prompt=True)
    with pytest.raises(ValueError):
        branch_text(tok, first, [{"role": "user", "content": "go"}])


def test_the_agents_reward_forms():
    no_transcript = lambda: []  # noqa: E731
    assert agent_reward(1, no_transcript, {}, None) == (1.0, {})
    assert agent_reward(True, no_transcript, {}, None) == (1.0, {})
    assert agent_reward({"reward": 0.5, "turns": 2}, no_transcript, {}, None) == (0.5, {"turns": 2})
    scored = agent_reward(None, lambda: [{"role": "user", "content": "q"}], {"answer": "q"},
                          lambda transcript, row: float(transcript[-1]["content"] == row["answer"]))
    assert scored == (1.0, {})
    for bad, kind in ((None, "malformed"), ("1", "malformed"), (float("inf"), "nonfinite_reward"),
                      ({"turns": 1}, "malformed")):
        with pytest.raises(MalformedStep) as e:
            agent_reward(bad, no_transcript, {}, None)
        assert e.value.kind == kind


def test_agent_options_are_checked():
    cfg = load_config(overrides=["data=calculator_agent"])
    assert cfg.env.text_env == "asyncppo.agents.episode.AgentEpisode" and cfg.env.agent.endswith(":agent")
    for overrides, named in ((["data=calculator", "env.agent=a.b:c"], "env.agent"),
                             (["env.reward_fn=a.b:c"], "env.reward_fn"),
                             (["data=calculator_agent", "env.agent=not a path"], "env.agent"),
                             (["data=calculator_agent", "env.agent_port=70000"], "env.agent_port"),
                             (["data=calculator_agent", "env.agent_max_body_bytes=0"], "env.agent_max_body_bytes"),
                             (["data=calculator_agent", "env.agent_branches=every"], "env.agent_branches")):
        with pytest.raises(ConfigError) as e:
            load_config(overrides=overrides)
        assert named in str(e.value), str(e.value)


def test_a_streamed_reply_reassembles_to_the_whole_completion():
    """stream=true: the chunks a client accumulates (content and tool calls by index, the finish reason, the
    extension, the usage when asked) give back exactly the non-streamed completion."""
    from asyncppo.agents.openai_format import completion_body, make_reply, stream_chunks

    req = parse({"messages": MSGS, "tools": TOOLS, "stream": True, "stream_options": {"include_usage": True}})
    assert req.stream and req.stream_usage
    text = 'sure <tool_call>{"name": "calc", "arguments": {"expr": "1+2"}}</tool_call>'
    reply = make_reply(text, "stop", req, "call-1")
    body = completion_body(reply, call_id="call-1", model="m", created=1, prompt_tokens=7, token_ids=[4, 5, 6],
                           logprobs=None, token_texts=None, versions=[3, 3, 4])
    chunks = stream_chunks(body, include_usage=True)
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "call-1" for c in chunks)
    content, calls, finish, extra, usage = "", {}, None, None, None
    for c in chunks:
        for ch in c["choices"]:
            content += ch["delta"].get("content") or ""
            for call in ch["delta"].get("tool_calls", []):
                calls[call["index"]] = {k: v for k, v in call.items() if k != "index"}
            finish = ch["finish_reason"] or finish
        extra = c.get("asyncppo", extra)
        usage = c.get("usage", usage)
    message = body["choices"][0]["message"]
    assert content == (message["content"] or "") and [calls[i] for i in sorted(calls)] == message["tool_calls"]
    assert finish == "tool_calls" and extra == {"token_ids": [4, 5, 6], "versions": [3, 3, 4]}
    assert usage == body["usage"] and len(stream_chunks(body, include_usage=False)) == 2


def _text(body: dict):
    return parse_completion_request(body, stop_token_id=lambda x: 7 if x == "\n" else None, vocab_size=100)


@pytest.mark.parametrize("body, named", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, 100]}, "0..99"),
    ({"prompt": [1, True]}, "prompt"), ({"prompt": "a", "stream": True}, "stream"), ({"prompt": "a", "echo": True},
    "echo"), ({"prompt": "a", "suffix": "z"}, "suffix"), ({"prompt": "a", "n": 2}, "n=2"),
    ({"prompt": "a", "best_of": 3}, "best_of"), ({"prompt": "a", "logprobs": 5}, "logprobs"),
    ({"prompt": "a", "logit_bias": {"1": 5}}, "logit_bias"), ({"prompt": "a", "stop": "ab"}, "stop"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"), ({"prompt": "a", "guided_json": {}}, "guided_json")])
def test_a_text_completion_that_cannot_be_honoured_is_refused_naming_the_field(body, named):
    with pytest.raises(RequestError) as e:
        _text(body)
    assert e.value.status == 400 and named in e.value.reason, e.value.reason


def test_a_text_completion_request_and_its_reply():
    r = _text({"prompt": "2+2=", "max_tokens": 4, "stop": "\n", "logprobs": 1, "temperature": 0.7, "model": "m"})
    assert (r.prompt_text, r.prompt_ids, r.max_tokens, r.stop, r.logprobs) == ("2+2=", None, 4, [7], True)
    assert _text({"prompt": [3, 4]}).prompt_ids == [3, 4] and not _text({"prompt": "x"}).logprobs
    assert _text({"prompt": "x", "logprobs": 0}).logprobs  # 0: the sampled tokens' log-probs (OpenAI's meaning)
    body = text_completion_body("4\n", "stop", call_id="c", model="m", created=1, prompt_tokens=4, token_ids=[9, 7],
                                logprobs=[-0.5, -1.5], token_texts=["4", "\n"], versions=[3, 3])
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["text"] == "4\n" and choice["finish_reason"] == "stop"
    assert choice["logprobs"] == {"tokens": ["4", "\n"], "token_logprobs": [-0.5, -1.5], "top_logprobs": None,
                                  "text_offset": [0, 1]}
    assert body["usage"]["total_tokens"] == 6 and body["asyncppo"] == {"token_ids": [9, 7], "versions": [3, 3]}
    later = text_completion_body("4\n", "stop", call_id="c", model="m", created=1, prompt_tokens=4, token_ids=[9, 7],
                                 logprobs=[-0.5, -1.5], token_texts=["4", "\n"], versions=[3, 3], text_offset=4)
    assert later["choices"][0]["logprobs"]["text_offset"] == [4, 5]  # counted from the prompt's start


def test_a_text_session_adds_what_each_prompt_extends_and_refuses_the_rest():
    s, loop = _session()
    call = s.accept(_text({"prompt": "count: "}), loop.create_future())
    assert call.raw == {"text": "count: "}
    s.reply(Reply("1 2", [], "stop"), {"asyncppo": {"token_ids": [5, 6, 7]}})
    for bad, kind in (({"prompt": "count: 1 3, go"}, "history_rewritten"),  # the completion edited
                      ({"prompt": [1, 2]}, "history_rewritten")):  # another prompt form
        with pytest.raises(RequestError) as e:
            s.accept(_text(bad), loop.create_future())
        assert e.value.status == 409 and e.value.kind == kind
    with pytest.raises(RequestError) as mixed:
        s.accept(parse({"messages": MSGS}), loop.create_future())
    assert mixed.value.status == 409 and mixed.value.kind == "mixed_api"
    nxt = s.accept(_text({"prompt": "count: 1 2, go on"}), loop.create_future())
    assert nxt.raw == {"text": ", go on"} and s.replied == [[5, 6, 7]]
    assert s.transcript() == [{"role": "completion", "content": "count: 1 2, go on"}]
    ids, loop2 = _session()
    ids.accept(_text({"prompt": [1, 2]}), loop2.create_future())
    ids.reply(Reply("x", [], "stop"), {"asyncppo": {"token_ids": [9, 7]}})
    assert ids.accept(_text({"prompt": [1, 2, 9, 7, 4]}), loop2.create_future()).raw == {"ids": [4]}
    loop.close()
    loop2.close()
