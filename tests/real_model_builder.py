"""A small model directory shaped like a real one, built locally: the fixture of the real-model end-to-end test.

The built-in ``tiny-*`` models take shortcuts a downloaded model never does: a char-level word tokenizer without a
chat template, one ``model.safetensors`` file, prompts that need no formatting. This builder produces what a user
brings instead (a Qwen2.5-Instruct-like directory, minus the size), so the path from ``model.path=DIR`` to a trained
checkpoint is exercised the way it is used:

* weights in several safetensors shards with a ``model.safetensors.index.json`` (``max_shard_size``), which the
  learner (transformers), the engine (vLLM) and the engine's parameter-shape check must all read as one model;
* a byte-level BPE tokenizer trained here with ``tokenizers`` and a Qwen-style ChatML ``chat_template``
  (``<|im_start|>role\\n...<|im_end|>\\n``, a default system turn, ``add_generation_prompt``), whose end-of-turn token
  is the eos, so generation stops where a chat model's answer ends;
* head_dim 64 (a head size vLLM's CPU attention supports), fp32, untied embeddings by default (``tied=True`` builds
  the other case for load checks: vLLM 0.32 fp32 on CPU needs ``lm_head.weight`` pushed explicitly then).

A random model scores ~0 on any question, which leaves the reward and evaluation paths untested in practice. So
:func:`build_real_model` can give the model a reflex first (``reflex_answer``): a few dozen supervised steps that
teach it to answer every *chat-formatted* question with ``#### <reflex_answer>`` and end its turn. With that, the
share of questions whose answer is the reflex number fixes the expected greedy accuracy exactly, by hand.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SYSTEM_PROMPT = "You are a helpful assistant."
# ChatML as Qwen2.5 writes it (trimmed to what a prompt dataset uses): a default system turn unless one is given.
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + SYSTEM_PROMPT + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NAMES = ["Tom", "Ana", "Sam", "Lee", "Mia", "Raj", "Zoe", "Ben"]
ITEMS = ["apples", "pens", "cards", "books", "coins", "eggs"]


def gsm8k_rows(n: int, seed: int, answers: list[int] | None = None) -> list[dict]:
    """GSM8K-format rows (``question``, ``answer`` ending in ``#### N``): ``a + b`` word problems. ``answers``, when
    given, fixes the final number of row ``i`` to ``answers[i % len(answers)]`` (the operands are drawn to fit)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        total = answers[i % len(answers)] if answers else rng.randint(2, 40)
        a = rng.randint(1, max(1, total - 1))
        b = total - a
        who, what = rng.choice(NAMES), rng.choice(ITEMS)
        rows.append({
            "question": f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?",
            "answer": f"{who} has {a} + {b} = {total} {what}.\n#### {total}",
        })
    return rows


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> str:
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def build_bpe_tokenizer(vocab_size: int = 384, seed: int = 0):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on synthetic GSM8K-like text, with ChatML specials and
    the chat template; eos is ``<|im_end|>`` (the end of an assistant turn), pad is ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [r["question"] + "\n" + r["answer"] for r in gsm8k_rows(400, seed)]
    corpus += [SYSTEM_PROMPT, "user", "assistant", "system", "#### 0123456789"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[ENDOFTEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT, padding_side="left", model_max_length=2048,
        chat_template=CHAT_TEMPLATE,
    )


def _teach_reflex(model, tokenizer, answer: str, steps: int, seed: int) -> float:
    """Supervised steps on chat-formatted questions -> ``#### <answer><|im_end|>`` (loss on the response only);
    returns the final loss. Questions are drawn from fresh rows so the reflex does not depend on the question."""
    import torch
    import torch.nn.functional as F

    rows = gsm8k_rows(64, seed + 1)
    target = tokenizer.encode(f"#### {answer}", add_special_tokens=False) + [tokenizer.eos_token_id]
    seqs, masks = [], []
    for r in rows:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}],
                                               add_generation_prompt=True, tokenize=False)
        p = tokenizer.encode(prompt, add_special_tokens=False)
        seqs.append(p + target)
        masks.append([0] * len(p) + [1] * len(target))
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        idx = torch.randperm(len(rows), generator=gen)[:16]
        logits = model(input_ids=ids[idx], attention_mask=attn[idx]).logits[:, :-1]
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[idx][:, 1:].reshape(-1), reduction="none")
        loss = (nll.view_as(mask[idx]) * mask[idx]).sum() / mask[idx].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def build_real_model(
    out_dir: str | os.PathLike,
    *,
    tied: bool = False,
    max_shard_size: str = "600KB",
    reflex_answer: str | None = None,
    reflex_steps: int = 60,
    hidden: int = 128,
    layers: int = 2,
    seed: int = 0,
) -> str:
    """Write a Qwen2ForCausalLM (fp32, head_dim 64) with the BPE chat tokenizer to ``out_dir`` in several shards."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_bpe_tokenizer(seed=seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64, head_dim=64,
        max_position_embeddings=2048, tie_word_embeddings=tied, rope_theta=10000.0, use_sliding_window=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        if reflex_answer is not None:
            torch.set_num_threads(1)  # two shared cores: one thread is faster for a model this small
            _teach_reflex(model, tokenizer, reflex_answer, reflex_steps, seed)
    # Neutral generation defaults: vLLM and transformers would otherwise apply sampling settings from here.
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)
