"""The local char-level tokenizers of the built-in models: their special tokens, and one with a Qwen-style chat
template for the multi-turn tasks.

Why here, in data/: the built-in models are built and warm-started by data/ (:mod:`asyncppo.data.tiny`), and the
multi-turn tasks (``data=calculator``) need a tokenizer that renders tool-calling conversations. data/ may not
import envs/ (the import contracts' layers), so the template and its tokenizer live here and
:mod:`asyncppo.envs.chat`, which renders episode turns with them, imports them from here.
"""

from __future__ import annotations

from typing import Optional, Sequence

PAD, EOS, UNK, BOS = "<pad>", "<eos>", "<unk>", "<bos>"
SPECIAL_TOKENS = [PAD, EOS, UNK, BOS]  # ids 0..3: pad is 0 so that zero-filled buffers read as padding

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

# The same layout with the tools' preamble cut to the list itself: what the built-in chat models carry. Qwen's
# ~480-character preamble would be two thirds of every calculator episode, and on two CPU cores the learner's and
# the warm start's cost is the sequence length (measured: 2.8 s per warm-start step of 16 transcripts with it).
TINY_TOOLS_TEMPLATE = QWEN_STYLE_TEMPLATE.replace(
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n", "").replace(
    "\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>", "")


def build_chat_tokenizer(alphabet: Optional[str] = None, template: str = QWEN_STYLE_TEMPLATE,
                         extra_tokens: Sequence[str] = ()):
    """A char-level fast tokenizer (one token per printable ASCII character, newline included) with the chat
    special tokens and ``template``: enough to render and tokenize tool-calling conversations locally.

    ``extra_tokens``: multi-character tokens in the vocabulary that encoding never produces (it splits text into
    characters). A model may sample them, and their text then re-encodes as other ids: the non-canonical
    tokenizations of a BPE vocabulary, made certain, for tests of the token-in/token-out rule."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # heavy: tokenizers
    from transformers import PreTrainedTokenizerFast  # heavy: transformers

    chars = list(dict.fromkeys(alphabet if alphabet is not None else "\n" + "".join(map(chr, range(32, 127)))))
    extra = [t for t in dict.fromkeys(extra_tokens) if t not in chars]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHAT_SPECIAL_TOKENS + chars + extra)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS + CHAT_SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, bos_token=BOS,
                                   padding_side="left", model_max_length=4096)
    fast.chat_template = template
    return fast
