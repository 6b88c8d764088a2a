"""The multi-turn peer (asyncppo/bench/peer_calc.py) feeds TRL's real tool loop the episodes asyncppo plays, token for
token: the prompt TRL renders, the tool turn it appends after a call, the call it parses and the reward it pays are
checked here against asyncppo's own chat rendering (envs/chat.py) and environment (envs/calculator.py), with TRL
1.16's own functions (its template checks, ``_get_tool_suffix_ids`` and ``parse_response``)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from asyncppo.bench.peer_calc import calc, final_answer_reward, trl_rows, trl_tokenizer
from asyncppo.data.calculator import CALC_TOOL, tool_call_text
from asyncppo.data.chat_tokenizer import IM_END, TINY_TOOLS_TEMPLATE, build_chat_tokenizer
from asyncppo.envs.calculator import CalculatorEnv
from asyncppo.envs.chat import turn_ids
from asyncppo.envs.tools import tool_message

pytestmark = pytest.mark.component
_VLLM_LEVEL = os.environ.get("VLLM_LOGGING_LEVEL")
trl = pytest.importorskip("trl", reason="the peer benchmarks' TRL (scripts/install.sh installs trl 1.16)")
# importing TRL sets VLLM_LOGGING_LEVEL=ERROR in this process's environment (trl/_compat.py): undone, so that no later
# test's vLLM inherits it from a test it does not know about
if _VLLM_LEVEL is None:
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
else:
    os.environ["VLLM_LOGGING_LEVEL"] = _VLLM_LEVEL

USER = [{"role": "user", "content": "What is 347*86?"}]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    """The tiny calculator model's tokenizer, loaded from a model directory as every part of a run loads it, and the
    copy TRL trains with. (The directory's Qwen2 config.json matters: with it transformers loads the tokenizer as a
    Qwen2Tokenizer, which encodes no whitespace; the parser's anchor must follow, peer_calc.trl_tokenizer.)"""
    from transformers import AutoTokenizer, Qwen2Config

    path = tmp_path_factory.mktemp("tok")
    build_chat_tokenizer(template=TINY_TOOLS_TEMPLATE).save_pretrained(path)
    Qwen2Config(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                tie_word_embeddings=False).save_pretrained(path)

    return AutoTokenizer.from_pretrained(path), trl_tokenizer(str(path))


def test_trl_renders_the_prompt_asyncppo_renders_and_passes_its_own_template_checks(toks):
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    ours, theirs = toks
    want = ours.apply_chat_template(USER, tools=[CALC_TOOL], tokenize=False, add_generation_prompt=True)
    got = theirs.apply_chat_template(trl_rows([{"prompt": USER[0]["content"], "answer": "29842"}])[0]["prompt"],
                                     tools=[calc], tokenize=False, add_generation_prompt=True)
    assert got == want and '"expr": {"type": "string"}}' in got  # CALC_TOOL's block, not transformers' schema
    # the stock template would be refused: it writes calls in the content and never renders tool_calls
    assert not supports_tool_calling(ours)
    assert supports_tool_calling(theirs) and is_chat_template_prefix_preserving(theirs)
    assert theirs.eos_token == IM_END and ours.eos_token != IM_END


def test_the_tool_turn_trl_appends_is_the_one_asyncppos_episode_appends(toks):
    from trl import GRPOTrainer

    ours, theirs = toks
    trainer = SimpleNamespace(processing_class=theirs, _tokenizer=theirs, chat_template=None, chat_template_kwargs={},
                              _is_vlm=False)
    for result in ("29842", calc("12*")):
        suffix = GRPOTrainer._get_tool_suffix_ids(trainer, [{"role": "tool", "name": "calc", "content": result}])
        # asyncppo: after a model turn that ended with its stop token <|im_end|>
        assert suffix == turn_ids(ours, [tool_message(result)], tools=[CALC_TOOL], model_stop_text=IM_END)
        assert theirs.decode(suffix).startswith(theirs.decode(theirs.encode(
            "\n<|im_start|>user\n<tool_response>\n" + result, add_special_tokens=False)))


def test_trl_parses_the_models_call_and_answer_as_the_environment_reads_them(toks):
    from trl.chat_template_utils import parse_response

    ours, theirs = toks
    prompt = theirs.apply_chat_template(USER, tools=[calc], tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    call = ours.encode(tool_call_text("347*86") + IM_END, add_special_tokens=False)
    parsed = parse_response(theirs, call, prefix=prompt, tools=[calc])
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "calc", "arguments": {"expr": "347*86"}}}]
    env = CalculatorEnv(extras={"answer": "29842"})
    replies, reward, done, _ = env.step(tool_call_text("347*86"))
    assert (reward, done, replies[0]["content"]) == (0.0, False, calc("347*86")) and calc("347*86") == "29842"
    answer = parse_response(theirs, ours.encode("29842" + IM_END, add_special_tokens=False), prefix=prompt)
    assert answer.get("content") == "29842" and not answer.get("tool_calls")
    assert env.step("29842")[1:3] == (1.0, True)


def test_the_reward_scores_the_last_turn_of_the_generated_ids_as_the_environment_does(toks):
    """From the ids TRL generated (every turn and tool turn after the prompt): a final exact answer pays, and a
    malformed call pays nothing, though TRL's parser (falling back to the text without special tokens) reads it as
    the answer."""
    from trl.chat_template_utils import parse_response

    ours, theirs = toks
    enc = lambda text: ours.encode(text, add_special_tokens=False)  # noqa: E731
    call = enc(tool_call_text("347*86") + IM_END)
    tool = turn_ids(ours, [tool_message("29842")], tools=[CALC_TOOL], model_stop_text=IM_END)
    malformed = enc("<tool_call>29842</tool_call>" + IM_END)
    episodes = {
        "the tool path": (call + tool + enc("29842" + IM_END), 1.0),
        "in the head": (enc("29842" + IM_END), 1.0),
        "a wrong answer": (call + tool + enc("29843" + IM_END), 0.0),
        "still calling at the turn limit": (call + tool + call + tool + call, 0.0),
        "a malformed call": (malformed, 0.0),
        "cut short, no stop token": (call + tool + enc("298"), 0.0),
    }
    got = final_answer_reward(theirs)(None, None, ["29842"] * len(episodes), [ids for ids, _ in episodes.values()])
    assert dict(zip(episodes, got)) == {name: want for name, (_, want) in episodes.items()}
    assert parse_response(theirs, malformed).get("content") == "29842"  # what the parsed messages would have paid
    assert calc("2+3*4") == "14" and calc("__import__('os')").startswith("error: unexpected character")
