"""Rendering environment turns to token ids with the tokenizer's chat template, without re-tokenizing the past.

Why: the model's tokens of a past turn are the ids the engine sampled. Decoding them to text and re-rendering the
whole conversation can tokenize differently (merges across the turn boundary, whitespace normalisation), and the
trained sequence would then differ from the one whose log-probs the engine reported: a silent off-policy error.
So an episode only ever *appends*: :func:`turn_ids` renders the new messages behind a fixed dummy conversation
and takes the text after it, which for a prefix-stable template (every chat template that renders a conversation
as a concatenation of per-message blocks, Qwen's and Llama's included) is exactly what a full render would put
there. It then adds back the part of the assistant turn's closing that the model did not generate itself (for
Qwen: the ``\\n`` after ``<|im_end|>``), so model ids + environment ids concatenate to the full render.

:data:`QWEN_STYLE_TEMPLATE` is a small Qwen-style template with tool syntax, and :func:`build_chat_tokenizer` a
local char-level tokenizer that carries it (the built-in tiny tokenizer of :mod:`asyncppo.data.tiny` has none).
"""

from __future__ import annotations

from typing import Any, Optional

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_SPECIAL_TOKENS = [IM_START, IM_END, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# Qwen2.5's layout, without its default system prompt: tools listed in the system turn, tool results as a user
# turn wrapped in <tool_response>, calls in the assistant's text as <tool_call>{json}</tool_call>.
QWEN_STYLE_TEMPLATE = (
    "{% if tools %}" + IM_START + "system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>" + IM_END + "\n"
    "{% elif messages[0].role == 'system' %}" + IM_START + "system\n{{ messages[0].content }}" + IM_END + "\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and message.role == 'system') %}"
    "{% if message.role == 'tool' %}" + IM_START + "user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    + IM_END + "\n"
    "{% else %}" + IM_START + "{{ message.role }}\n{{ message.content }}" + IM_END + "\n"
    "{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)

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


def turn_ids(tokenizer: Any, new_messages: list, **kw) -> list:
    """The token ids of :func:`turn_text`: what an episode appends (loss mask 0) after a model turn."""
    return tokenizer.encode(turn_text(tokenizer, new_messages, **kw), add_special_tokens=False)


def build_chat_tokenizer(alphabet: Optional[str] = None, template: str = QWEN_STYLE_TEMPLATE):
    """A char-level fast tokenizer (one token per printable ASCII character, newline included) with the chat
    special tokens and ``template``: enough to render and tokenize tool-calling conversations locally."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # heavy: tokenizers
    from transformers import PreTrainedTokenizerFast  # heavy: transformers

    from asyncppo.data.tiny import BOS, EOS, PAD, SPECIAL_TOKENS, UNK

    chars = list(dict.fromkeys(alphabet if alphabet is not None else "\n" + "".join(map(chr, range(32, 127)))))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHAT_SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS + CHAT_SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, bos_token=BOS,
                                   padding_side="left", model_max_length=4096)
    fast.chat_template = template
    return fast
