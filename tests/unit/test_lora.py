"""LoRA through peft on a real tiny Qwen2 (docs/lora.md): the options are checked by name, the reference is the base
model exactly, the optimiser holds moments for the adapters alone, and a LoRA learner resumed from a checkpoint
continues bit for bit (through build_models, the checkpoint's merged actor and its adapter)."""

from __future__ import annotations

import os

import pytest
import torch

from asyncppo.config import ConfigError, load_config
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner import checkpoint as C
from asyncppo.learner.build import build_models
from asyncppo.learner.forward import policy_forward
from asyncppo.learner.lora import ADAPTER_DIR, AdaptersOff, LoraExport, adapter_tensors
from asyncppo.learner.models import load_actor

from test_checkpoint import _batches, _cfg  # every stateful part of the update switched on

CPU = torch.device("cpu")
RANK = 4
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, heads=1, intermediate=128, seed=3)


def _lora_cfg(**model) -> AsyncPPOConfig:
    cfg = _cfg()
    cfg.model.lora_rank, cfg.model.lora_alpha = RANK, 8.0
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return cfg


def _opt_bytes(opt) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten() for t in tensors])


@pytest.mark.parametrize("override, key", [
    ("model.lora_rank=-1", "model.lora_rank"),
    ("model.lora_alpha=0", "model.lora_alpha"),
    ("model.lora_dropout=1.0", "model.lora_dropout"),
    ("model.lora_target_modules=[]", "model.lora_target_modules"),
    ("model.lora_target_modules=[q_proj,embed_tokens]", "model.lora_target_modules"),
    ("model.lora_target_modules=[all-linear,q_proj]", "model.lora_target_modules"),
    ("cluster.train_gpus=2", "model.lora_rank"),
    ("model.lora_target_parameters=['']", "model.lora_target_parameters"),
    ("model.lora_target_parameters=[mlp.experts.down_proj] model.lora_dropout=0.1", "model.lora_dropout"),
])
def test_lora_options_are_validated_by_name(override, key):
    base = [] if override.startswith("model.lora_rank") else ["model.lora_rank=8"]
    with pytest.raises(ConfigError) as info:
        load_config([*base, *override.split(" ")])
    assert key in str(info.value)


def test_lora_defaults_are_off_and_all_linear():
    cfg = load_config(["model.lora_rank=8"])
    assert AsyncPPOConfig().model.lora_rank == 0
    assert cfg.model.lora_target_modules == ["all-linear"] and cfg.model.lora_alpha == 16.0


def test_reference_is_the_base_model_with_no_second_copy(model_dir):
    cfg = _lora_cfg()
    cfg.algorithm.add_token_level_kl = True  # the run needs a reference
    torch.manual_seed(0)
    models = build_models(cfg, model_dir, None, CPU, 0, 1)
    assert isinstance(models.reference, AdaptersOff) and list(models.reference.parameters()) == []
    for b in _batches(0, 2):  # the adapters move away from B = 0
        models.updater.step(b)
    batch = _batches(5, 1)[0]
    base = load_actor(model_dir, torch.float32, CPU)
    with torch.no_grad():
        ref_lp = policy_forward(models.reference, batch, 1.0, False)[0]
        base_lp = policy_forward(base, batch, 1.0, False)[0]
        actor_lp = policy_forward(models.actor, batch, 1.0, False)[0]
    assert (ref_lp - base_lp).abs().max().item() < 1e-6
    assert (actor_lp - base_lp).abs().max().item() > 1e-3  # the adapters are live, so the check above can fail


def test_optimizer_state_shrinks_to_the_adapters(model_dir):
    """AdamW keeps exp_avg and exp_avg_sq (plus a step scalar) per trainable tensor: bytes computed from the shapes."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    h, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                 "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    adapter_numel = c.num_hidden_layers * sum(RANK * (i + o) for i, o in per_layer.values())
    sizes = {}
    for lora in (False, True):
        cfg = _lora_cfg() if lora else _cfg()
        if not lora:
            cfg.model.lora_rank = 0
        torch.manual_seed(0)
        models = build_models(cfg, model_dir, None, CPU, 0, 1)
        actor, updater = models.actor, models.updater
        updater.step(_batches(0, 1)[0])
        trainable = [p for p in actor.parameters() if p.requires_grad]
        sizes[lora] = (_opt_bytes(updater.actor_opt), sum(p.numel() for p in trainable), len(trainable))
    full_numel = sum(p.numel() for p in load_actor(model_dir, torch.float32, CPU).parameters())
    assert sizes[True][1] == adapter_numel
    assert sizes[False][1] == full_numel
    for lora, numel in ((True, adapter_numel), (False, full_numel)):
        assert sizes[lora][0] == 2 * 4 * numel + 4 * sizes[lora][2]  # fp32 moments + one fp32 step per tensor
    print(f"optimizer state: full {sizes[False][0]} B, LoRA r={RANK} {sizes[True][0]} B "
          f"({sizes[True][0] / sizes[False][0]:.4f})")


def _save(run_dir, version, models, tokenizer_dir):
    from transformers import AutoTokenizer

    return C.save_checkpoint(run_dir, version, actor=LoraExport(models.actor),
                             tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), updater=models.updater,
                             critic=models.critic, keep=2)


def test_lora_learner_resumes_bit_for_bit(model_dir, tmp_path):
    cfg = _lora_cfg()  # gae critic, adaptive KL in the reward (reference = adapters off), running reward norm
    torch.manual_seed(0)
    a = build_models(cfg, model_dir, None, CPU, 0, 1)
    for b in _batches(0, 3):
        a.updater.step(b)
    ckpt = _save(str(tmp_path / "run"), 3, a, model_dir)
    metrics_a = [a.updater.step(b) for b in _batches(3, 2)]

    # the checkpoint's actor/ is the merged model (engines, users) and actor/adapter the adapter (resume)
    assert os.path.isfile(os.path.join(ckpt.actor_dir, ADAPTER_DIR, "adapter_model.safetensors"))
    C.check_compatible(ckpt, model_dir, needs_critic=True)
    torch.manual_seed(999)
    found = C.resolve_checkpoint(str(tmp_path / "run"))
    b = build_models(cfg, model_dir, found, CPU, 0, 1)
    state = C.restore(found, b.updater, b.critic)
    assert state["version"] == 3
    metrics_b = [b.updater.step(x) for x in _batches(3, 2)]
    assert torch.equal(_flat(adapter_tensors(a.actor).values()), _flat(adapter_tensors(b.actor).values()))
    assert torch.equal(_flat(a.critic.parameters()), _flat(b.critic.parameters()))
    for key in ("actor/lr", "actor/kl_coef", "actor/pg_loss", "critic/vf_loss"):
        assert [m[key] for m in metrics_a] == [m[key] for m in metrics_b], key
    sa, sb = a.updater.actor_opt.state_dict()["state"], b.updater.actor_opt.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_merged_export_is_the_adapted_policy(model_dir, tmp_path):
    """final/ and a checkpoint's actor/ load as a plain Hugging Face model equal to the adapted actor."""
    from transformers import AutoModelForCausalLM

    cfg = _lora_cfg()
    torch.manual_seed(0)
    models = build_models(cfg, model_dir, None, CPU, 0, 1)
    for b in _batches(0, 2):
        models.updater.step(b)
    LoraExport(models.actor).save_pretrained(str(tmp_path / "final"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32)
    batch = _batches(7, 1)[0]
    with torch.no_grad():
        got = policy_forward(merged, batch, 1.0, False)[0]
        want = policy_forward(models.actor, batch, 1.0, False)[0]
    assert (got - want).abs().max().item() < 1e-5
    # only linear projections of the decoder layers carry adapters
    assert {n.split(".")[-3] for n in adapter_tensors(models.actor)} == set(LINEARS)


def test_verl_lora_keys_convert():
    from asyncppo.config.convert import convert

    text = ("actor_rollout_ref:\n  model:\n    path: /models/q\n    lora_rank: 32\n    lora_alpha: 64\n"
            "    target_modules: [q_proj, v_proj]\n    lora_adapter_path: /x\n")
    result = convert(text, "verl")
    assert result.values["model.lora_rank"] == 32 and result.values["model.lora_alpha"] == 64.0
    assert result.values["model.lora_target_modules"] == ["q_proj", "v_proj"]
    for key in ("lora_rank", "lora_alpha", "target_modules"):
        assert result.entries["actor_rollout_ref.model." + key].status == "mapped"
    assert result.entries["actor_rollout_ref.model.lora_adapter_path"].status == "unsupported"
    assert convert(text.replace("[q_proj, v_proj]", "all-linear"), "verl").values[
        "model.lora_target_modules"] == ["all-linear"]


class _Recorder:
    def __init__(self):
        self.calls = []

    def update_weights(self, named):
        self.calls.append(dict(named))


def test_merger_hands_whole_layer_groups_merged_onto_the_base_and_names_bad_pushes(model_dir):
    from safetensors.torch import load_file

    from asyncppo.sync.adapter import AdapterMerger

    base = load_file(os.path.join(model_dir, "model.safetensors"))
    w0 = base["model.layers.1.mlp.down_proj.weight"]  # [hidden, intermediate]
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(RANK, w0.shape[1], generator=g), torch.randn(w0.shape[0], RANK, generator=g)
    engine = _Recorder()
    merger = AdapterMerger(engine, model_dir, scale=2.0)
    module = "model.layers.1.mlp.down_proj"
    for _ in range(2):  # the same adapter twice: merged onto W0 both times, not onto the previous merge
        merger.update_weights([(module + ".lora_A.weight", a), (module + ".lora_B.weight", b)])
    got = engine.calls[-1]
    assert torch.equal(got[module + ".weight"], engine.calls[0][module + ".weight"])
    assert torch.allclose(got[module + ".weight"], w0 + 2.0 * b @ a, atol=1e-6)
    layer = {n for n in base if n.startswith("model.layers.1.")}
    assert set(got) == layer  # the whole group, so vLLM reloads its fused layers whole
    assert all(torch.equal(got[n], base[n]) for n in layer if n != module + ".weight")
    with pytest.raises(ValueError, match="only one of lora_A / lora_B"):
        merger.update_weights([(module + ".lora_A.weight", a)])
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        merger.update_weights([(module + ".weight", w0)])
    with pytest.raises(KeyError, match="no base weight"):
        merger.update_weights([("model.layers.9.x.lora_A.weight", a), ("model.layers.9.x.lora_B.weight", b)])
    with pytest.raises(ValueError, match="do not make the base weight"):
        merger.update_weights([(module + ".lora_A.weight", a.T), (module + ".lora_B.weight", b.T)])


def test_gradient_checkpointing_still_trains_the_adapters(model_dir):
    """Every adapter moves in a step with activation checkpointing on (the embeddings below them are frozen)."""
    cfg = _lora_cfg(gradient_checkpointing=True)
    torch.manual_seed(0)
    models = build_models(cfg, model_dir, None, CPU, 0, 1)
    before = {n: t.clone() for n, t in adapter_tensors(models.actor).items()}
    models.updater.step(_batches(0, 1)[0])
    moved = [n for n, t in adapter_tensors(models.actor).items() if not torch.equal(t, before[n])]
    assert len(moved) == len(before), sorted(set(before) - set(moved))[:3]


def _moe():
    from transformers import Qwen2Config

    from asyncppo.data.tiny_moe import moe_model

    torch.manual_seed(0)
    return moe_model(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                 max_position_embeddings=64), experts=4, top_k=2, expert_intermediate=16)


def test_all_linear_on_a_mixture_of_experts_adapts_attention_and_the_push_merges_onto_checkpoint_weights(tmp_path):
    """peft's own all-linear would also wrap the fused experts and routers as parameters (the push then stopped the
    engine: 'no base weight for model.layers.0.mlp.experts'); here the adapters sit on the linear layers, each a
    B @ A that sync/adapter.py merges onto a checkpoint weight of the saved model, and the merged weights change
    the output exactly as the adapted model does."""
    from asyncppo.learner.lora import lora_actor, merged_state_dict

    base = _moe()
    base.save_pretrained(tmp_path / "moe")
    cfg = _lora_cfg()
    actor = lora_actor(base, cfg.model)
    pushed = adapter_tensors(actor)
    modules = {n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in pushed}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj"}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "moe" / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    assert all(n.rsplit(".lora_", 1)[0] + ".weight" in names for n in pushed)
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # adapters that do something
        ids = torch.randint(1, 32, (2, 6))
        adapted = actor(input_ids=ids).logits
        plain = _moe()
        plain.load_state_dict(merged_state_dict(actor))
        assert torch.allclose(plain(input_ids=ids).logits, adapted, atol=1e-5)


def test_lora_on_fused_experts_is_refused_by_name():
    """Adapters on parameters that were not asked for (what peft's own all-linear makes of fused experts and
    routers) are refused by name, as are adapters on a router; naming the experts as a target module peft refuses
    itself."""
    from peft import LoraConfig, get_peft_model

    from asyncppo.learner.lora import _refuse_parameter_adapters, lora_actor

    cfg = _lora_cfg()
    wrapped = get_peft_model(_moe(), LoraConfig(r=RANK, lora_alpha=8.0, target_modules="all-linear"))
    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.*as parameters"):
        _refuse_parameter_adapters(wrapped, cfg.model)
    with pytest.raises(ValueError, match="not supported"):
        lora_actor(_moe(), _lora_cfg(lora_target_modules=["q_proj", "experts"]).model)
    with pytest.raises(ValueError, match="mlp.gate.weight.*are routers"):
        lora_actor(_moe(), _lora_cfg(lora_target_modules=["q_proj"], lora_target_parameters=["mlp.gate.weight"]).model)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_adapters_on_the_fused_experts_push_their_update_and_engines_merge_it_exactly(tmp_path):
    """``model.lora_target_parameters``: peft adapts the fused expert tensors; the push carries each one's update
    (``<parameter>.lora_delta``, peft's own ``get_delta_weight``), the merger renames it into the checkpoint's
    per-expert names and hands ``W0 + update`` for whole layers, and a real transformers engine started from the
    saved base then computes the adapted actor's logits; the merged export does too. Only the adapters train."""
    from asyncppo.learner.lora import lora_actor, merged_state_dict
    from asyncppo.rollout.hf_engine import HFEngine
    from asyncppo.sync.adapter import AdapterMerger

    base = _moe()
    base.save_pretrained(tmp_path / "moe")
    cfg = _lora_cfg(lora_target_modules=["q_proj", "v_proj"], lora_target_parameters=EXPERTS)
    actor = lora_actor(base, cfg.model)
    assert all("lora_" in n for n, p in actor.named_parameters() if p.requires_grad)
    with torch.no_grad():
        for n, p in actor.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # adapters that do something
    pushed = adapter_tensors(actor)
    updates = sorted(n for n in pushed if n.endswith(".lora_delta"))
    assert updates == [f"model.layers.{i}.mlp.experts.{p}.lora_delta" for i in range(2)
                       for p in ("down_proj", "gate_up_proj")]
    fused = dict(_moe().named_parameters())
    assert all(pushed[n].shape == fused[n[: -len(".lora_delta")]].shape for n in updates)
    assert {n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in pushed if n not in updates} == {"q_proj", "v_proj"}
    ids = torch.randint(1, 32, (2, 6))
    with torch.no_grad():
        adapted = actor(input_ids=ids).logits
        plain = _moe()
        plain.load_state_dict(merged_state_dict(actor))
        assert torch.allclose(plain(input_ids=ids).logits, adapted, atol=1e-5)
    engine = HFEngine(str(tmp_path / "moe"), max_model_len=64)
    try:
        merger = AdapterMerger(engine, str(tmp_path / "moe"), scale=cfg.model.lora_alpha / cfg.model.lora_rank)
        with torch.no_grad():
            before = engine.model(input_ids=ids).logits
            merger.update_weights(pushed.items())
            after = engine.model(input_ids=ids).logits
        assert not torch.allclose(before, adapted, atol=1e-3) and torch.allclose(after, adapted, atol=1e-5)
    finally:
        engine.close()


def test_per_expert_checkpoint_names_gather_back_into_the_fused_parameters():
    """The transformers engine keeps fused experts; a merge hands the checkpoint's per-expert names: gathered back,
    exactly the fused tensors (gate rows, then up), and an incomplete set is refused by name."""
    from asyncppo.sync.expert_names import to_checkpoint_names, to_model_names

    model = _moe()
    state = model.state_dict()
    known = {n for n, _ in to_checkpoint_names(state.items(), {f"model.layers.{i}.mlp.experts.0.{p}.weight"
                                                                for i in range(2)
                                                                for p in ("gate_proj", "up_proj", "down_proj")})}
    pieces = list(to_checkpoint_names(state.items(), known))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in dict(pieces)
    back = dict(to_model_names(pieces, state))
    assert set(back) == set(state) and all(torch.equal(back[n], state[n]) for n in state)
    with pytest.raises(ValueError, match="experts.gate_up_proj.*missing.*2.up_proj"):
        to_model_names([p for p in pieces if p[0] != "model.layers.0.mlp.experts.2.up_proj.weight"], state)
