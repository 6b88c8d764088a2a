"""Mixture of experts through the real parts: the built-in ``tiny-moe``, expert pushes into vLLM and transformers,
and a plain ``save_pretrained`` MoE directory loaded the way ``model.path=<dir>`` loads it.

Why a push test of its own: transformers 5 keeps experts fused (``mlp.experts.gate_up_proj``, 3-D), the checkpoint a
vLLM engine validates against names them per expert, and vLLM's CPU MoE kernel prepacks them, so a push that loads
"successfully" could still leave the engine's experts stale (measured: 0.12 nats off before the fix,
asyncppo/rollout/vllm_cpu_moe.py). The check is the engine's own packed tensors against the learner's weights packed
the same way, and the engine's sampled-token log-probs against transformers' with the pushed weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from asyncppo.sync.engine_load import layer_group

MOE = {"experts": 8, "top_k": 2, "expert_intermediate": 256}
PROMPTS = ["07+45=", "12+34=", "99+01="]


def _engine_lp_error(engine, model, tok) -> float:
    """Largest |engine log-prob - transformers log-prob| over sampled tokens of PROMPTS."""
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    worst = 0.0
    for p, group in zip(prompts, engine.generate(prompts, n=2, max_tokens=6, temperature=1.0, seed=1)):
        for c in group:
            toks = [int(t) for t in c.token_ids]
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([p + toks])).logits[0, :-1].float(), -1)
            ref = torch.stack([lp[len(p) - 1 + i, t] for i, t in enumerate(toks)])
            worst = max(worst, float((ref - torch.tensor(c.logprobs)).abs().max()))
    return worst


def _perturb(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() > 1 and float(p.std()) > 0:
                p.add_(torch.randn(p.shape, generator=g) * 0.3 * p.std())


def _push_in_layer_groups(engine, state: dict) -> int:
    """Push ``state`` as the sync loader does: whole layer groups per call (learner names: experts fused)."""
    groups: dict[str, list] = {}
    for name, t in state.items():
        groups.setdefault(layer_group(name), []).append((name, t))
    for named in groups.values():
        engine.update_weights(named)
    return len(groups)


def _engine_experts(engine) -> tuple[dict[str, torch.Tensor], str]:
    """The engine's packed expert tensors and its MoE kernel's ISA (in-process engine: read on its worker)."""
    def read(worker):
        model = worker.model_runner.model
        isa = model.model.layers[0].mlp.experts.routed_experts.quant_method.moe_kernel.fused_experts.isa
        return {n: p.detach().clone() for n, p in model.named_parameters() if "routed_experts" in n}, isa
    (out,) = engine.llm.collective_rpc(read)
    return out


def test_tiny_moe_builtin_is_a_top2_of_8_mixture_and_its_warm_start_beats_chance(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from asyncppo.data.tasks import get_task
    from asyncppo.data.tiny import build_tiny_model, resolve_model_path
    from asyncppo.data.warmstart import answer_accuracy
    from asyncppo.sync.expert_names import is_moe_config

    path = resolve_model_path("builtin:tiny-moe", cache_dir=str(tmp_path / "cache"))
    assert Path(path).name.startswith("tiny-moe-")
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.model_type == "qwen3_moe" and is_moe_config(cfg)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim, cfg.tie_word_embeddings) == (8, 2, 64, False)
    assert cfg.mlp_only_layers == [] and cfg.decoder_sparse_step == 1  # every layer routes
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape) == (8, 2 * 256, 128)
    sft = json.loads((Path(path) / "build.json").read_text())["sft"]
    # chance: the same architecture untrained, on the same held-out prompts
    raw = build_tiny_model(str(tmp_path / "raw"), seed=0, moe=MOE)
    held = get_task("addition", seed=0).splits().eval
    chance = answer_accuracy(AutoModelForCausalLM.from_pretrained(raw, dtype=torch.float32),
                             AutoTokenizer.from_pretrained(raw), held, temperature=0.0)
    print(f"tiny-moe warm start: greedy {sft['greedy_acc']:.3f} sampled {sft['sampled_acc']:.3f}, untrained {chance}")
    assert chance <= 0.01 and sft["greedy_acc"] >= 0.08 and sft["sampled_acc"] >= 0.03, (sft, chance)


def test_expert_push_reaches_vllm_packed_experts_and_the_hf_engine(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm._custom_ops import cpu_prepack_moe_weight

    from asyncppo.data.tiny import build_tiny_model
    from asyncppo.rollout.hf_engine import HFEngine
    from asyncppo.rollout.vllm_engine import VLLMEngine

    path = build_tiny_model(str(tmp_path / "moe"), seed=0, moe=MOE)
    tok = AutoTokenizer.from_pretrained(path)
    learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMEngine(path, max_model_len=64, seed=0)
    try:
        assert _engine_lp_error(engine, learner, tok) < 1e-4
        _perturb(learner, seed=3)
        assert _push_in_layer_groups(engine, learner.state_dict()) == 5  # embedding, 2 layers (experts inside), norm, head
        got, isa = _engine_experts(engine)
        for i, layer in enumerate(learner.model.layers):
            experts = layer.mlp.experts
            for attr, mine in (("w13_weight", experts.gate_up_proj), ("w2_weight", experts.down_proj)):
                want = cpu_prepack_moe_weight(mine.detach().contiguous(), isa)  # the kernel's layout on this CPU
                name = f"model.layers.{i}.mlp.experts.routed_experts.{attr}"
                assert torch.equal(got[name], want), name
        assert _engine_lp_error(engine, learner, tok) < 1e-4  # it samples with the pushed experts
    finally:
        engine.close()
    hf = HFEngine(path, max_model_len=64)
    try:
        hf.update_weights(learner.state_dict().items())
        mine = learner.state_dict()
        assert all(torch.equal(t, mine[n]) for n, t in hf.model.state_dict().items())
    finally:
        hf.close()


def test_a_save_pretrained_moe_directory_loads_in_learner_and_both_engines(tmp_path):
    """A checkpoint made by transformers alone (no asyncppo build): what ``model.path=<dir>`` hands the roles."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from asyncppo.data.tiny import build_tokenizer, resolve_model_path
    from asyncppo.learner.models import load_actor
    from asyncppo.rollout.hf_engine import HFEngine
    from asyncppo.rollout.vllm_engine import VLLMEngine

    d = tmp_path / "ckpt"
    tok = build_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, moe_intermediate_size=64, num_experts=4,
                         num_experts_per_tok=1, tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, max_position_embeddings=256)
    torch.manual_seed(1)
    Qwen3MoeForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    path = resolve_model_path(str(d))
    assert path == str(d)
    actor = load_actor(path, torch.float32, torch.device("cpu")).eval()
    assert tuple(actor.model.layers[2].mlp.experts.down_proj.shape) == (4, 128, 64)
    tokenizer = AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(path, max_model_len=64, seed=0)
    try:
        assert _engine_lp_error(engine, actor, tokenizer) < 1e-4
        _perturb(actor, seed=5)
        _push_in_layer_groups(engine, actor.state_dict())
        assert _engine_lp_error(engine, actor, tokenizer) < 1e-4
    finally:
        engine.close()
    hf = HFEngine(path, max_model_len=64)
    try:
        out = hf.generate([tokenizer.encode("12+34=", add_special_tokens=False)], n=2, max_tokens=4, temperature=1.0)
        assert len(out[0]) == 2
    finally:
        hf.close()
