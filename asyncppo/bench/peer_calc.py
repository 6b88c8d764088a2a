"""``asyncppo bench peer-calculator``: asyncppo against TRL's multi-turn GRPO on ``data=calculator``, accuracy
against time.

The multi-turn peer (issue #48 item 4). TRL 1.16's ``GRPOTrainer`` plays tool-calling episodes itself when given
``tools=``: it generates a turn, parses the tool calls with the tokenizer's response parser, runs the Python tool,
appends the tool turn's tokens (from the chat template) to the generated ids, generates again, up to
``max_tool_calling_iterations`` times, and masks the tool turns out of the loss. That is asyncppo's episode loop in
a synchronous trainer: every turn of the whole batch waits for the batch's slowest row.

Same task on both sides, from the same model (``builtin:tiny-calculator``, the preset's warm start at the run's
seed): the preset's rows, 16 prompts x 8 episodes per update, lr 1e-4, GRPO without KL, each sample used once, at
most 3 model turns (a call, the answer after its result, one spare: ``max_tool_calling_iterations=2``), 192
completion tokens in all and 64 a turn (TRL's ``generation_kwargs.max_new_tokens``), and the environment's reward
(:func:`final_answer_reward`: the last turn, read from the generated ids, stepped through ``CalculatorEnv``).

What TRL needs of the tokenizer, and what :func:`trl_tokenizer` gives it without changing one token the model sees:

* **a chat template that renders assistant ``tool_calls``** (TRL checks it, ``supports_tool_calling``). The tiny
  model's template writes calls in the assistant's text; the TRL copy adds a ``tool_calls`` branch in the model's
  own call syntax (compact JSON in ``<tool_call>`` tags), used only by TRL's checks and its tool-suffix dummy;
* **the tools block exactly as the model was warm-started on it.** TRL passes the tool as a Python function and
  transformers turns it into a schema with an empty argument description and a return type that asyncppo's
  ``CALC_TOOL`` does not have; the TRL copy renders ``CALC_TOOL`` itself in that place;
* **a response parser**: TRL sets one only for chat templates it knows verbatim, so the copy carries TRL's own
  Qwen parser (``<tool_call>`` JSON, content up to ``<|im_end|>``), which reads the model's syntax;
* **``<|im_end|>`` as eos**: TRL stops a turn at eos and cuts the tool suffix after it; the model ends its turns
  with ``<|im_end|>`` (its ``<eos>`` stays a stop token too).

tests/component/test_peer_calculator_trl.py holds TRL to this on the path a well-formed episode takes: the prompt,
the tool turn TRL appends after a call, the call it parses and the reward are token for token what asyncppo's
episode loop uses. Off that path TRL differs by its design:

* a malformed call ends TRL's episode (scored 0 here, as the environment scores the turn), where asyncppo answers it
  with an error turn and the episode goes on;
* a call of an unknown tool or with wrong arguments gets TRL's ``{'error': ...}`` reply, not the environment's.

Both sides' points are scored after both trained, by one probe (:func:`score`): the run's own held-out evaluation
of the calculator task (asyncppo/envs/calculator_eval.py: ``rows`` held-out rows, 100 by default, one greedy and 4
sampled episodes each, on a vLLM engine, played by the environment, every row's sampling seeded alike for every
model). The clocks and thresholds are peer_long.py's; asyncppo's clock (its learner's) includes its checkpoint writes
(~0.02 s each), TRL's leaves its saves out. TRL's own seed stays 0 (peer.py); the seed sets the warm start both use.
"""

from __future__ import annotations

import json
import os

import torch

from asyncppo.bench.peer_long import preset, report, run_asyncppo_long, run_trl_setups
from asyncppo.data.calculator import CALC_TOOL, evaluate_expression
from asyncppo.data.chat_tokenizer import EOS, IM_END, IM_START, TINY_TOOLS_TEMPLATE
from asyncppo.data.tasks import get_task
from asyncppo.data.tiny import model_of
from asyncppo.envs.calculator import CalculatorEnv

PRESET = "data=calculator"
_TOOLS_LOOP = "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
_ASSISTANT = "{% else %}" + IM_START + "{{ message.role }}\n{{ message.content }}" + IM_END + "\n"
_ASSISTANT_WITH_CALLS = (
    "{% else %}" + IM_START + "{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    + IM_END + "\n")


def trl_chat_template() -> str:
    """The tiny chat model's template (``TINY_TOOLS_TEMPLATE``) with what TRL needs (module docstring): assistant
    ``tool_calls`` rendered in the model's call syntax, and the tools block rendered from ``CALC_TOOL``."""
    for part in (_TOOLS_LOOP, _ASSISTANT):
        if TINY_TOOLS_TEMPLATE.count(part) != 1:
            raise RuntimeError(f"the tiny chat template changed: {part!r} is not in it once")
    tools = "{% for tool in tools %}\n{% raw %}" + json.dumps(CALC_TOOL) + "{% endraw %}{% endfor %}"
    return TINY_TOOLS_TEMPLATE.replace(_TOOLS_LOOP, tools).replace(_ASSISTANT, _ASSISTANT_WITH_CALLS)


def trl_tokenizer(model_dir: str):
    """The model's tokenizer as TRL's tool loop needs it (module docstring): the template of
    :func:`trl_chat_template`, ``<|im_end|>`` as eos, and TRL's Qwen response parser."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = trl_chat_template()
    tok.eos_token = IM_END
    # The parser finds the model's turn by its header's *decoded* text. Loaded from a model directory, the tiny
    # chat tokenizer encodes no whitespace (transformers builds it as a Qwen2Tokenizer, whose byte-level
    # pre-tokenizer maps " " and "\n" to symbols the char vocabulary lacks), so the header decodes without its
    # newline, and with Qwen's anchor the parser would read the whole conversation as one turn.
    header = tok.decode(tok.encode(IM_START + "assistant\n", add_special_tokens=False))
    tok.response_template = {**qwen3_template, "start_anchor": header}
    return tok


def calc(expr: str) -> str:
    """Evaluate integers with + - *

    Args:
        expr: the expression, digits and + - * only
    """
    try:
        return str(evaluate_expression(expr))
    except ValueError as e:  # as asyncppo's environment answers a refused expression
        return f"error: {e}"


def final_answer_reward(tokenizer):
    """TRL's reward function (its signature) scoring an episode as ``CalculatorEnv`` scores it: the episode's last
    model turn, read from the ids TRL generated (``completion_ids``: every turn and tool turn after the prompt),
    decoded with its special tokens as asyncppo's episode loop decodes a turn (its stop token left out), and stepped
    through the environment: 1 for a turn without a call whose text is exactly the product, 0 for a wrong answer, a
    call (the turn limit reached) or a malformed call.

    Why not TRL's parsed messages: where its parser fails (``<tool_call>29842</tool_call>``) it falls back to the
    text without special tokens, which would read a malformed call as the answer ``29842``."""
    header = tokenizer.encode(IM_START + "assistant\n", add_special_tokens=False)
    stops = {tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(EOS)}

    def reward(prompts, completions, answer, completion_ids, **kw) -> list[float]:
        out = []
        for ids, truth in zip(completion_ids, answer):
            ids = list(ids)
            starts = [i + len(header) for i in range(len(ids) - len(header) + 1) if ids[i:i + len(header)] == header]
            turn = ids[starts[-1]:] if starts else ids
            turn = turn[:-1] if turn and turn[-1] in stops else turn
            env = CalculatorEnv(extras={"answer": truth})
            out.append(float(env.step(tokenizer.decode(turn, skip_special_tokens=False))[1]))
        return out

    return reward


def trl_rows(rows: list[dict]) -> list[dict]:
    """The task's rows as TRL's conversational prompts (the user turn; TRL adds the tools block)."""
    return [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]


def score(model_dir: str, *, rows: int, seed: int) -> dict:
    """The probe: calculator_eval's held-out episodes (vLLM), as ``sampled`` / ``greedy`` for curves.py."""
    from asyncppo.envs.calculator_eval import heldout_success

    out = heldout_success(model_dir, rows=rows, samples=4, seed=seed, engine="vllm")
    return {"sampled": out["success_sampled"], "greedy": out["success_greedy"],
            "tool_use": out["tool_use_sampled"]}


def run(opts: dict, seed: int, work: str) -> dict:
    """One seed: both contenders for ``seconds`` of training each, every point scored after both trained."""
    torch.set_num_threads(opts["threads"])
    overrides = [*opts["overrides"], f"trainer.seed={seed}"]
    cfg = preset(overrides, PRESET)
    seconds, points = opts["seconds"], opts["points"]
    marks = [seconds * k / points for k in range(1, points + 1)]
    train = get_task(cfg.data.task, seed=cfg.data.seed).splits().train
    model_dir = os.path.abspath(model_of(cfg))
    print(f"[peer-calculator] {seconds:.0f} s of training each, points at {[round(m) for m in marks]} s; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    if "asyncppo" not in opts["skip"]:
        results.append(run_asyncppo_long(overrides, work, marks, preset=PRESET, save_every=opts["save_every"]))

    def trainer_kwargs() -> dict:
        tok = trl_tokenizer(model_dir)
        return {"reward": final_answer_reward(tok), "tools": [calc], "tokenizer": tok,
                "config": {"max_tool_calling_iterations": cfg.env.max_turns - 1,
                           # every turn, the first and those after a tool turn, capped as asyncppo caps it
                           "generation_kwargs": {"max_new_tokens": cfg.env.max_tokens_per_turn}}}

    results += run_trl_setups(opts["trl"], opts["skip"], cfg, model_dir, trl_rows(train), work, marks, trainer_kwargs)
    start = score(model_dir, rows=opts["rows"], seed=cfg.trainer.seed)
    for r in results:
        for point in r["points"]:
            point.update(score(point["path"], rows=opts["rows"], seed=cfg.trainer.seed))
            print(f"[peer-calculator]   {r['name']} step {point['step']} ({point['train_s']:.0f} s): sampled "
                  f"{point['sampled']:.3f} greedy {point['greedy']:.3f} tool use {point['tool_use']:.2f}", flush=True)
    doc = {"start": start, "results": results, "seconds": seconds}
    return report(doc, work, "bench_peer_calculator", f"data=calculator, seed {seed}", "peer-calculator")
