"""Agent programs through the OpenAI-compatible endpoint (agents/): the real vLLM CPU engine, a real aiohttp server
on loopback, the real ``openai`` client, the episode loop of envs/episodes.py.

* Token-in, token-out: an agent makes three calls, each time sending the whole conversation back as text. The
  episode's trained ids are the ids each call sampled (as its reply reported them) with only the agent's new
  messages rendered in between, the reported log-probs are the record's, and re-rendering the decoded conversation
  tokenizes *differently* (the tokenizer has multi-character tokens that encoding never produces; the random model
  samples them): what training on the agent's text would have got wrong.
* Hostile calls made by an agent during its own episode (a wrong key, an unknown session, malformed JSON, a body
  over the limit, unsupported fields, a concurrent call, a rewritten history under ``env.agent_branches=refuse``):
  each is refused with its status and counted, and the episode's record is still exactly its admitted calls. A late
  call after the episode: 410. (Under the default, a rewrite starts a branch: its own test below.)
* Agents that raise, never call, or hang between calls end their own episodes as faults (``env.on_error``); the
  other episode of the group still trains.

The agents run in the agent host's child process (agents/host.py), as in a run: what they saw comes back to the test
through files in ``row["log_dir"]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from asyncppo.agents.episode import AgentEpisode
from asyncppo.agents.server import AgentServer
from asyncppo.envs.chat import build_chat_tokenizer, turn_ids
from asyncppo.envs.env_runner import EnvRunner
from asyncppo.envs.episodes import EpisodeEngine
from asyncppo.rollout.engine import SamplingSpec

# ~45 s in all on the 2-core box (a vLLM engine, an agent process per test, deadlines of 2 s on purpose): the fast
# tier keeps the endpoint's pure parts (tests/unit/test_agent_format.py)
pytestmark = pytest.mark.slow

#: the engine's context: the Agents SDK's prompt (its tool schema, char-level tokens) is ~670 tokens
MAX_MODEL_LEN, RESPONSE_LENGTH = 1024, 160
#: two-letter tokens the char-level encoder never produces (build_chat_tokenizer's extra_tokens)
EXTRA = sorted({a + b for a in "etaoinsh" for b in "etaoinsh"})


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_chat_tokenizer(extra_tokens=EXTRA)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_MODEL_LEN,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=tok.bos_token_id, use_sliding_window=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float32).eval()
    out = str(tmp_path_factory.mktemp("agent-model"))
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out, tok


@pytest.fixture(scope="module")
def engine(chat_model):
    from vllm_required import require_vllm

    require_vllm()
    from asyncppo.rollout.engines import make_engine

    eng = make_engine("vllm", chat_model[0], dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, kv_cache_gib=1,
                      enable_prefix_caching=True, block_size=32)
    yield eng
    eng.close()


class Rig:
    """A server, a runner and the episode loop around the shared engine, torn down after each test."""

    def __init__(self, engine, tok, agent, *, step_timeout_s: float = 30.0, on_error: str = "zero_reward",
                 max_body_bytes: int = 1 << 16, branches: str = "final"):
        self.tok = tok
        self.server = AgentServer(f"{__name__}:{agent.__name__}", max_body_bytes=max_body_bytes, model_name="tiny",
                                  stop_token_id=lambda s: None, branches=branches).start()
        self.runner = EnvRunner(8, step_timeout_s, on_error)
        self.episodes = EpisodeEngine(engine, tok, self.runner, max_turns=4, response_length=RESPONSE_LENGTH,
                                      turn_max_tokens=12, max_prompt_tokens=MAX_MODEL_LEN - RESPONSE_LENGTH)
        self.wait_s = step_timeout_s + 2

    def run_group(self, key: str, row: dict, n: int, deadline_s: float = 120.0) -> list:
        eps = [AgentEpisode(self.server, row, wait_s=self.wait_s, tokenizer=self.tok) for _ in range(n)]
        self.last_episodes = eps
        self.episodes.add_group(key, None, SamplingSpec(n=n, max_tokens=12, seed=7), eps, prompt_messages=[])
        got, t0 = [], time.monotonic()
        while not got:
            assert time.monotonic() - t0 < deadline_s, "the group did not come back"
            got = self.episodes.step()
            if not self.episodes.engine.num_unfinished_seqs():
                time.sleep(0.005)
        return got

    def close(self):
        self.server.close()
        self.runner.shutdown()


@pytest.fixture
def rig(engine, chat_model):
    made = []

    def make(agent, **kw):
        made.append(Rig(engine, chat_model[1], agent, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


# ------------------------------------------------------------------------------------------------ agents
def _log(row: dict, entry: dict) -> None:
    Path(row["log_dir"], f"{uuid.uuid4().hex}.json").write_text(json.dumps(entry))


def _logs(log_dir) -> list:
    return [json.loads(p.read_text()) for p in Path(log_dir).glob("*.json")]


def _sampled(resp) -> dict:
    """What the test keeps of a reply: the sampled ids, their log-probs, the usage."""
    extra = resp.model_extra["asyncppo"]
    lps = [x.logprob for x in resp.choices[0].logprobs.content] if resp.choices[0].logprobs else None
    return {"ids": extra["token_ids"], "versions": extra["versions"], "logprobs": lps,
            "completion_tokens": resp.usage.completion_tokens, "content": resp.choices[0].message.content}


async def three_calls(client, row):
    """Three calls, the conversation sent back as text each time; the replies are logged for the test."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": row["prompt"]}]
    calls = []
    for k in range(3):
        resp = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, logprobs=True)
        calls.append(_sampled(resp))
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        messages.append({"role": "user", "content": f"and {k}?"})
    _log(row, {"calls": calls, "messages": messages[:-1]})
    return {"reward": 2.5, "calls": 3}


def test_trained_ids_are_the_sampled_ids_not_the_retokenized_text(rig, tmp_path):
    r = rig(three_calls)
    row = {"prompt": "say something", "log_dir": str(tmp_path)}
    (group,) = r.run_group("g0", row, n=2)
    tok = r.tok
    logs = _logs(tmp_path)
    assert len(group.completions) == 2 and len(logs) == 2
    extra_ids = set(tok.convert_tokens_to_ids(EXTRA))
    differs = 0
    for c in group.completions:
        ids = [int(t) for t in c.token_ids]
        log = next(x for x in logs if x["calls"][0]["ids"] == ids[:len(x["calls"][0]["ids"])])
        # the record: each call's sampled ids, then only the new user message rendered (mask 0), turn by turn
        expected, lps, pos = [], [], []
        for k, call in enumerate(log["calls"]):
            sampled = call["ids"]
            pos += range(len(expected), len(expected) + len(sampled))
            expected += sampled
            lps += call["logprobs"]
            assert call["completion_tokens"] == len(sampled) and call["versions"] == [0] * len(sampled)
            if k < 2:
                stop = "<|im_end|>" if sampled and sampled[-1] == tok.convert_tokens_to_ids("<|im_end|>") else ""
                expected += turn_ids(tok, [{"role": "user", "content": f"and {k}?"}], model_stop_text=stop)
        assert ids == expected
        assert [tuple(x) for x in c.env_runs] and c.reward == 2.5 and list(c.turn_rewards) == [0.0, 0.0, 2.5]
        np.testing.assert_allclose(np.asarray(c.logprobs)[pos], lps, rtol=0, atol=1e-6)
        assert np.all(np.asarray(c.versions) == 0)
        # the agent's own text of the conversation, rendered and tokenized again, is not what was sampled
        text = tok.apply_chat_template(log["messages"], tokenize=False)
        prompt = tok.encode(tok.apply_chat_template(log["messages"][:2], tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
        retokenized = tok.encode(text, add_special_tokens=False)[len(prompt):]
        if retokenized[:len(ids)] != ids:
            differs += 1
        assert extra_ids & set(ids), "the model sampled none of the multi-character tokens (seeded: it does)"
    assert differs == 2
    assert r.server.refusals == {} and r.server.calls == 6


async def streamed_calls(client, row):
    """Two calls with stream=true (and the usage chunk), the reply accumulated from the chunks as a streaming
    client does; the second call sends the first reply back as text."""
    messages = [{"role": "user", "content": row["prompt"]}]
    calls = []
    for k in range(2):
        stream = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, logprobs=True,
                                                      stream=True, stream_options={"include_usage": True})
        content, ids, finish, usage = "", None, None, None
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
            extra = (chunk.model_extra or {}).get("asyncppo")
            ids = extra["token_ids"] if extra else ids
            usage = chunk.usage or usage
        calls.append({"content": content, "ids": ids, "finish": finish, "completion_tokens": usage.completion_tokens})
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"again {k}"}]
    _log(row, {"calls": calls})
    return 1.5


def test_a_streaming_client_gets_the_turn_as_events_and_trains_the_ids_it_sampled(rig, tmp_path):
    r = rig(streamed_calls)
    (group,) = r.run_group("s0", {"prompt": "stream please", "log_dir": str(tmp_path)}, n=1)
    (log,) = _logs(tmp_path)
    (c,) = group.completions
    ids = [int(t) for t in c.token_ids]
    first, second = (call["ids"] for call in log["calls"])
    assert ids[: len(first)] == first and ids[-len(second):] == second and c.reward == 1.5
    for call in log["calls"]:
        assert call["completion_tokens"] == len(call["ids"]) and call["finish"] in ("stop", "length")
        stop = call["finish"] == "stop"  # the turn's stop token is not part of the reply's text (envs/episodes.py)
        assert call["content"] == r.tok.decode(call["ids"][:-1] if stop else call["ids"], skip_special_tokens=False)


# ------------------------------------------------------------------------------------------------ hostile
async def hostile(client, row):
    """One admitted call, then every kind of bad call at its own session and the server; statuses logged."""
    base, key = str(client.base_url).rstrip("/"), client.api_key
    first = [{"role": "user", "content": "hello"}]
    resp = await client.chat.completions.create(model="tiny", messages=first, max_tokens=6, logprobs=True)
    reply = {"role": "assistant", "content": resp.choices[0].message.content}
    ok = {"Authorization": f"Bearer {key}"}
    statuses = {}
    async with aiohttp.ClientSession() as http:
        async def post(name, url, body=None, headers=ok, raw=None):
            data = raw if raw is not None else json.dumps(body)
            async with http.post(url, data=data, headers={**headers, "Content-Type": "application/json"}) as r:
                got = await r.json()
                statuses[name] = (r.status, got["error"]["message"] if r.status != 200 else "")
                return got

        chat = f"{base}/chat/completions"
        good = {"model": "tiny", "messages": first + [reply, {"role": "user", "content": "more"}], "max_tokens": 6}
        await post("wrong_key", chat, good, headers={"Authorization": "Bearer nope"})
        await post("no_key", chat, good, headers={})
        await post("unknown_session", chat.replace(base.split("/sessions/")[1].split("/")[0], "0" * 32), good)
        await post("no_session", base.split("/sessions/")[0] + "/v1/chat/completions", good)
        await post("malformed_json", chat, raw=b"{not json")
        await post("too_large", chat, raw=json.dumps({"messages": [{"role": "user", "content": "x" * 70000}]}))
        await post("stream", chat, {**good, "stream": "yes"})
        await post("n", chat, {**good, "n": 3})
        await post("unknown_field", chat, {**good, "frobnicate": 1})
        await post("bad_role", chat, {**good, "messages": [{"role": "wizard", "content": "x"}]})
        await post("rewritten", chat, {**good, "messages": [{"role": "user", "content": "HELLO"}, reply,
                                                            {"role": "user", "content": "more"}]})
        await post("injected_assistant", chat, {**good, "messages": good["messages"] + [
            {"role": "assistant", "content": "I say so"}]})
        # two calls at once on one session: one is admitted, the other refused (either may arrive first)
        results = await asyncio.gather(post("concurrent-a", chat, good), post("concurrent-b", chat, good))
    admitted = [r for r in results if "choices" in r]
    _log(row, {"statuses": statuses, "first": _sampled(resp),
               "second": admitted[0]["asyncppo"]["token_ids"] if len(admitted) == 1 else None, "base": base,
               "key": key})
    return 1.0


def test_hostile_calls_are_refused_with_a_status_and_the_episode_still_trains(rig, tmp_path):
    # env.agent_branches=refuse: an appended assistant message is then refused (under the default it starts a branch,
    # which test_an_agent_that_rewrites_its_history_trains_its_branches covers)
    r = rig(hostile, max_body_bytes=1 << 16, branches="refuse")
    (group,) = r.run_group("h0", {"log_dir": str(tmp_path)}, n=1)
    (log,) = _logs(tmp_path)
    s = log["statuses"]
    expected = {"wrong_key": 401, "no_key": 401, "unknown_session": 404, "no_session": 404, "malformed_json": 400,
                "too_large": 413, "stream": 400, "n": 400, "unknown_field": 400, "bad_role": 400, "rewritten": 409,
                "injected_assistant": 409}
    concurrent = sorted(s.pop(k) for k in ("concurrent-a", "concurrent-b"))
    assert {k: v[0] for k, v in s.items()} == expected, s
    assert "stream='yes'" in s["stream"][1] and "'frobnicate'" in s["unknown_field"][1] and "n=3" in s["n"][1]
    assert "do not extend" in s["rewritten"][1]
    assert concurrent[0][0] == 200 and concurrent[1][0] == 409 and "in flight" in concurrent[1][1], concurrent
    assert sum(r.server.refusals.values()) == len(expected) + 1
    # the record is exactly the two admitted calls
    (c,) = group.completions
    first, second = log["first"]["ids"], log["second"]
    ids = [int(t) for t in c.token_ids]
    assert ids[:len(first)] == first and ids[-len(second):] == second and c.reward == 1.0
    # after the episode: the session is gone (410), the server still answers
    import urllib.request
    import urllib.error

    req = urllib.request.Request(f"{log['base']}/chat/completions", method="POST",
                                 data=json.dumps({"messages": [{"role": "user", "content": "late"}]}).encode(),
                                 headers={"Authorization": f"Bearer {log['key']}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as late:
        urllib.request.urlopen(req, timeout=10)
    assert late.value.code == 410


# ------------------------------------------------------------------------------------------------ faults
def _claim(row: dict) -> int:
    """The first of ``row["roles"]`` no other episode of the group claimed (a file each, created exclusively)."""
    for j in row["roles"]:
        try:
            os.close(os.open(os.path.join(row["log_dir"], f"role-{j}"), os.O_CREAT | os.O_EXCL))
            return j
        except FileExistsError:
            continue
    raise AssertionError("more episodes than roles")


async def faulty(client, row):
    """Episode j of the group: 0 behaves, 1 raises after a call, 2 never calls, 3 hangs after a call."""
    j = _claim(row)
    if j == 2:
        await asyncio.sleep(3600)
    resp = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6)
    if j == 1:
        raise KeyError("the agent's own bug")
    if j == 3:
        await asyncio.sleep(3600)
    return float(len(resp.choices[0].message.content or "") >= 0)


def test_agents_that_raise_never_call_or_hang_fault_their_own_episodes(rig, tmp_path):
    r = rig(faulty, step_timeout_s=2.0, on_error="zero_reward")
    t0 = time.monotonic()
    (group,) = r.run_group("f0", {"roles": [0, 1, 2, 3], "log_dir": str(tmp_path)}, n=4, deadline_s=60)
    # the never-calling agent fails its episode's init at the deadline, which drops the group under zero_reward too
    # (an init fault leaves no prompt to train); the hanging agent is cancelled with it, which is not a fault
    assert group.dropped and ("timeout" in group.detail or "within" in group.detail), group.detail
    assert time.monotonic() - t0 < 20
    assert dict(r.runner.faults) == {"raised": 1, "timeout": 1, "malformed": 0, "nonfinite_reward": 0}


def test_a_group_whose_agents_fault_after_calling_still_trains_the_good_episode(rig, tmp_path):
    r = rig(faulty, step_timeout_s=2.0, on_error="zero_reward")
    (group,) = r.run_group("f1", {"roles": [0, 1, 3], "log_dir": str(tmp_path)}, n=3, deadline_s=60)
    assert not group.dropped and len(group.completions) == 3
    ended = sorted(c.ended for c in group.completions)
    assert ended == ["done", "raised", "timeout"], ended
    good = next(c for c in group.completions if c.ended == "done")
    assert good.reward == 1.0 and all(c.reward == 0.0 for c in group.completions if c is not good)


async def exits_then_behaves(client, row):
    """The first episode of the first group kills the agent process (a crash of the user's code, not an exception);
    every later episode makes one call."""
    resp = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
    if row.get("crash"):
        try:
            os.close(os.open(os.path.join(row["log_dir"], "crashed"), os.O_CREAT | os.O_EXCL))
            os._exit(3)
        except FileExistsError:
            await asyncio.sleep(3600)  # the other episode: ends with the process
    return float(resp.choices[0].finish_reason in ("stop", "length"))


def test_a_crashed_agent_process_fails_its_episodes_and_the_next_group_gets_a_new_one(rig, tmp_path):
    r = rig(exits_then_behaves, step_timeout_s=20.0, on_error="zero_reward")
    t0 = time.monotonic()
    (crashed,) = r.run_group("c0", {"crash": True, "log_dir": str(tmp_path)}, n=2, deadline_s=60)
    assert time.monotonic() - t0 < 15  # the process's end is seen at once, not at the episodes' deadline
    assert [c.ended for c in crashed.completions] == ["raised", "raised"]
    assert r.runner.faults["raised"] == 2 and r.runner.faults["timeout"] == 0
    (after,) = r.run_group("c1", {"log_dir": str(tmp_path)}, n=2, deadline_s=60)
    assert [c.reward for c in after.completions] == [1.0, 1.0] and r.server.agents.restarts == 1


def model_runs(c) -> list:
    """The model's token runs of an episode: the response split at its environment runs."""
    ids, out, pos = [int(t) for t in c.token_ids], [], 0
    for start, length in [tuple(map(int, r)) for r in c.env_runs]:
        out.append(ids[pos:start])
        pos = start + length
    return out + [ids[pos:]]


async def summarising_agent(client, row):
    """Two calls, then the context "too long": the agent keeps its first two messages and a note of its own in place
    of the exchange (a rewrite: a new branch), and makes two more calls on that conversation."""
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": row["prompt"]}]
    log, messages = {"before": [], "after": []}, list(first)
    for phase, opening in (("before", []), ("after", [{"role": "assistant", "content": "(a note)"},
                                                      {"role": "user", "content": "go on"}])):
        if opening:
            messages = first + opening
        for k in range(2):
            resp = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            log[phase].append(_sampled(resp))
            messages = messages + [{"role": "assistant", "content": resp.choices[0].message.content},
                                   {"role": "user", "content": f"{phase} {k}"}]
    _log(row, log)
    return 1.0


def _between(tok, sampled: list, text: str) -> list:
    """The user message ``text`` rendered after a model turn that sampled ``sampled``."""
    stop = "<|im_end|>" if sampled and sampled[-1] == tok.convert_tokens_to_ids("<|im_end|>") else ""
    return turn_ids(tok, [{"role": "user", "content": text}], model_stop_text=stop)


@pytest.mark.parametrize("branches", ["final", "all"])
def test_an_agent_that_rewrites_its_history_trains_its_branches(rig, tmp_path, branches):
    """A rewrite starts a branch. Its sample is the prompt (the first call's messages), the rewritten conversation
    after it as one masked segment (exactly the template's text between the prompt and the full rendering), then
    the new branch's sampled ids. ``final``: the first branch's turns are dropped and counted; ``all``: they are a
    sample of their own (its sampled ids with the agent's message between them, ended ``branch``), paid the
    episode's reward at its last turn."""
    from asyncppo.envs.chat import branch_text

    r = rig(summarising_agent, branches=branches)
    (group,) = r.run_group("br0", {"prompt": "tell me", "log_dir": str(tmp_path)}, n=2)
    tok, logs = r.tok, _logs(tmp_path)
    finals = [c for c in group.completions if c.ended != "branch"]
    kept = [c for c in group.completions if c.ended == "branch"]
    assert not group.dropped and len(finals) == 2 and len(logs) == 2 and len(kept) == (2 if branches == "all" else 0)
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me"}]
    opening = tok.encode(branch_text(tok, first, [{"role": "assistant", "content": "(a note)"},
                                                  {"role": "user", "content": "go on"}]), add_special_tokens=False)
    dropped = 0
    for c, ep in zip(finals, r.last_episodes):
        log = next(x for x in logs if [x["after"][0]["ids"], x["after"][1]["ids"]] == model_runs(c)[1:])
        a0, a1 = log["after"][0]["ids"], log["after"][1]["ids"]
        between = _between(tok, a0, "after 0")
        assert [int(t) for t in c.token_ids] == opening + a0 + between + a1
        assert [tuple(map(int, x)) for x in c.env_runs] == [(0, len(opening)), (len(opening) + len(a0), len(between))]
        assert model_runs(c)[0] == [] and ep.session.replied == [a0, a1] and ep.session.branches == 1
        assert list(c.turn_rewards) == [0.0, 1.0] and np.all(np.asarray(c.versions) == 0)
        dropped += sum(len(x["ids"]) for x in log["before"])
        if branches == "all":  # the first branch: its two calls' sampled ids, the agent's message between them
            b0, b1 = log["before"][0]["ids"], log["before"][1]["ids"]
            (old,) = [k for k in kept if model_runs(k) == [b0, b1]]
            assert [int(t) for t in old.token_ids] == b0 + _between(tok, b0, "before 0") + b1
            assert list(old.turn_rewards) == [0.0, 1.0] and old.reward == c.reward == 1.0
    assert group.prompt_ids == tok.encode(tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True),
                                          add_special_tokens=False)
    assert r.episodes.counters["branches"] == 2
    assert r.episodes.counters["branch_tokens_dropped"] == (dropped if branches == "final" else 0)
    assert r.server.refusals == {} and r.server.calls == 8


def blocking_agent(client, row):
    """A plain function: it gets a blocking client and runs on a thread of the agent process."""
    first = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "again"}]
    client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    return 0.5


def test_a_plain_function_agent_runs_on_a_thread_with_a_blocking_client(rig):
    r = rig(blocking_agent)
    (group,) = r.run_group("b0", {}, n=2)
    assert [c.reward for c in group.completions] == [0.5, 0.5]
    for c, ep in zip(group.completions, r.last_episodes):
        assert model_runs(c) == ep.session.replied and len(ep.session.replied) == 2


async def sdk_agent(client, row):
    """An agent of the OpenAI Agents SDK (its own loop, its own request fields), launched unchanged."""
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def lookup(word: str) -> str:
        """Look a word up.

        Args:
            word: the word
        """
        return word.upper()

    model = OpenAIChatCompletionsModel(model="tiny", openai_client=client)
    result = await Runner.run(Agent(name="t", instructions="be brief", model=model, tools=[lookup]), "say hi",
                              max_turns=2)
    return float(isinstance(result.final_output, str))


def test_an_agents_sdk_agent_trains_the_ids_it_sampled(rig):
    r = rig(sdk_agent)
    (group,) = r.run_group("s0", {}, n=2)
    assert not group.dropped and [c.reward for c in group.completions] == [1.0, 1.0], group
    for c, ep in zip(group.completions, r.last_episodes):
        assert model_runs(c) == ep.session.replied and ep.session.replied
    assert r.server.refusals == {}


# ------------------------------------------------------------------------------------------------ /v1/completions
def _text_sampled(resp) -> dict:
    extra = resp.model_extra["asyncppo"]
    lp = resp.choices[0].logprobs
    return {"ids": extra["token_ids"], "logprobs": lp.token_logprobs if lp else None, "text": resp.choices[0].text}


async def text_agent(client, row):
    """Three text completions, the prompt each time the whole text so far (the completions as returned) plus a
    question; between them the calls a text session refuses. The replies and refusals are logged for the test."""
    import openai

    text, calls, refused = row["prompt"], [], {}

    async def refusal(name, **kw):
        try:
            await client.completions.create(model="tiny", **kw)
        except openai.APIStatusError as e:
            refused[name] = e.status_code

    for k in range(3):
        resp = await client.completions.create(model="tiny", prompt=text, max_tokens=8, logprobs=1)
        calls.append(_text_sampled(resp))
        text += resp.choices[0].text + f" and {k}?"
        if k == 0:
            await refusal("rewritten", prompt="something else entirely", max_tokens=4)
            await refusal("stream", prompt=text, max_tokens=4, stream=True)
            await refusal("batch", prompt=[text, text], max_tokens=4)
            await refusal("n", prompt=text, max_tokens=4, n=2)
            try:
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            except openai.APIStatusError as e:
                refused["mixed"] = e.status_code
    _log(row, {"calls": calls, "refused": refused, "text": text})
    return 1.0


async def ids_agent(client, row):
    """Token ids in, token ids out: each prompt is the ids so far, the sampled ids as returned, and ids of its own."""
    ids, calls = list(row["prompt_ids"]), []
    for k in range(2):
        resp = await client.completions.create(model="tiny", prompt=ids, max_tokens=6)
        calls.append(_text_sampled(resp))
        ids = ids + calls[-1]["ids"] + list(row["extra_ids"])
    _log(row, {"calls": calls})
    return 1.0


def test_text_completions_train_the_sampled_ids_with_only_the_added_text_tokenized(rig, tmp_path):
    """/v1/completions: a text agent's episode is its first prompt, then each completion's sampled ids and the text
    its next prompt added, tokenized alone; re-tokenizing the agent's final text gives other ids (the model samples
    multi-character tokens encoding never produces). A prompt that does not extend the text, a stream, a batch of
    prompts, n = 2, and a chat call on a text session are refused (409, 400, 400, 400, 409) and train nothing."""
    r = rig(text_agent)
    row = {"prompt": "say something:", "log_dir": str(tmp_path)}
    (group,) = r.run_group("t0", row, n=2)
    tok, differs = r.tok, 0
    extra_ids = set(tok.convert_tokens_to_ids(EXTRA))
    prompt_ids = tok.encode(row["prompt"], add_special_tokens=True)  # the first prompt: as vLLM's endpoint does
    for c, log in zip(sorted(group.completions, key=lambda c: list(c.token_ids)),
                      sorted(_logs(tmp_path), key=lambda x: x["calls"][0]["ids"])):
        assert log["refused"] == {"rewritten": 409, "stream": 400, "batch": 400, "n": 400, "mixed": 409}, log
        assert [int(t) for t in group.prompt_ids] == prompt_ids
        expected, lps, pos = [], [], []
        for k, call in enumerate(log["calls"]):
            pos += range(len(expected), len(expected) + len(call["ids"]))
            expected += call["ids"]
            lps += call["logprobs"]
            if k < 2:
                expected += tok.encode(f" and {k}?", add_special_tokens=False)
        ids = [int(t) for t in c.token_ids]
        assert ids == expected
        np.testing.assert_allclose(np.asarray(c.logprobs)[pos], lps, rtol=0, atol=1e-6)
        assert len(c.env_runs) == 2 and c.reward == 1.0
        if tok.encode(log["text"], add_special_tokens=True)[len(prompt_ids):] != ids:
            differs += 1
        assert extra_ids & set(ids), "the model sampled none of the multi-character tokens (seeded: it does)"
    assert differs == 2
    assert r.server.calls == 6 and sum(r.server.refusals.values()) == 10, r.server.refusals


def test_token_id_prompts_train_exactly_the_ids_sent_and_sampled(rig, tmp_path):
    r = rig(ids_agent)
    tok = r.tok
    row = {"prompt_ids": tok.encode("count:", add_special_tokens=False),
           "extra_ids": tok.encode(" more", add_special_tokens=False), "log_dir": str(tmp_path)}
    (group,) = r.run_group("i0", row, n=2)
    logs = _logs(tmp_path)
    for c in group.completions:
        ids = [int(t) for t in c.token_ids]
        log = next(x for x in logs if x["calls"][0]["ids"] == ids[:len(x["calls"][0]["ids"])])
        first, second = (call["ids"] for call in log["calls"])
        assert [int(t) for t in group.prompt_ids] == row["prompt_ids"]
        assert ids == first + row["extra_ids"] + second
    assert r.server.calls == 4 and not r.server.refusals
