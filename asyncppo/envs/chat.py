"""Rendering environment turns to token ids with the tokenizer's chat template, without re-tokenizing the past.

Why: the model's tokens of a past turn are the ids the engine sampled. Decoding them to text and re-rendering the
whole conversation can tokenize differently (merges across the turn boundary, whitespace normalisation), and the
trained sequence would then differ from the one whose log-probs the engine reported: a silent off-policy error.
So an episode only ever *appends*: :func:`turn_ids` renders the new messages behind a fixed dummy conversation
and takes the text after it, which for a prefix-stable template (every chat template that renders a conversation
as a concatenation of per-message blocks, Qwen's and Llama's included) is exactly what a full render would put
there. It then adds back the part of the assistant turn's closing that the model did not generate itself (for
Qwen: the ``\\n`` after ``<|im_end|>``), so model ids + environment ids concatenate to the full render.

:data:`QWEN_STYLE_TEMPLATE` (a small Qwen-style template with tool syntax) and :func:`build_chat_tokenizer` (a
local char-level tokenizer that carries it) live in :mod:`asyncppo.data.chat_tokenizer`, so that data/ can build
the built-in chat models; they are re-exported here.
"""

from __future__ import annotations

from typing import Any, Optional

from asyncppo.data.chat_tokenizer import (  # noqa: F401  (re-exported: the names envs/ and tests use)
    CHAT_SPECIAL_TOKENS, IM_END, IM_START, QWEN_STYLE_TEMPLATE, build_chat_tokenizer)

_MARK = "\u2063ASSISTANT-TURN\u2063"  # content of the dummy assistant turn: where the model's text would end
_DUMMY = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]


def _render(tokenizer: Any, messages: list, tools: Optional[list], add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def turn_text(tokenizer: Any, new_messages: list, *, tools: Optional[list] = None, model_stop_text: str = "",
              add_generation_prompt: bool = True) -> str:
    """The text the template puts after an assistant turn whose generated text ended with ``model_stop_text``
    (e.g. ``"<|im_end|>"`` when the engine returns the stop token, ``""`` when it does not): the rest of the
    assistant turn's closing, then ``new_messages``, then (by default) the next assistant header. ValueError when
    the template is not prefix-stable or the model's stop text is not how it closes an assistant turn."""
    base = _render(tokenizer, _DUMMY, tools, False)
    full = _render(tokenizer, _DUMMY + list(new_messages), tools, add_generation_prompt)
    if not full.startswith(base):
        raise ValueError("the chat template is not prefix-stable: rendering more messages changed the text of earlier "
                         "ones, so environment turns cannot be appended without re-tokenizing")
    closing = base[base.rindex(_MARK) + len(_MARK):]
    if not closing.startswith(model_stop_text):
        raise ValueError(f"the template closes an assistant turn with {closing!r}, which does not begin with the "
                         f"model's stop text {model_stop_text!r}")
    return closing[len(model_stop_text):] + full[len(base):]


def branch_text(tokenizer: Any, first_messages: list, rest: list, *, tools: Optional[list] = None) -> str:
    """The text a new branch of an episode puts after its prompt: the conversation ``first_messages + rest``
    rendered with the next assistant header, less the prompt's own rendering (``first_messages`` with the assistant
    header). ``rest`` empty or beginning with an assistant message, so the prompt's header opens its first message.
    ValueError when the template does not render the longer conversation as the prompt followed by more text."""
    prompt = _render(tokenizer, list(first_messages), tools, True)
    full = _render(tokenizer, list(first_messages) + list(rest), tools, True)
    if not full.startswith(prompt):
        raise ValueError("the rewritten conversation does not render as the episode's prompt followed by more text "
                         "(its first messages changed, or it does not go on with an assistant message)")
    return full[len(prompt):]


def turn_ids(tokenizer: Any, new_messages: list, **kw) -> list:
    """The token ids of :func:`turn_text`: what an episode appends (loss mask 0) after a model turn."""
    return tokenizer.encode(turn_text(tokenizer, new_messages, **kw), add_special_tokens=False)
