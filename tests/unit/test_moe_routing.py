"""Routing replay on a real transformers Qwen3-MoE: the hooks of asyncppo/models/moe_routing.py.

Checked: replaying a model's own choices changes nothing bit for bit; forcing other experts changes the output to
exactly what those experts compute; gradients still reach the router; disagreement and expert load are counted as
by hand; a record of the wrong shape or length is refused."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen2Config, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from asyncppo.models.moe_routing import NO_EXPERT, RoutingHooks, RoutingRecorder, moe_routers, routing_shape  # noqa: E402


def _model(top_k=2, experts=4, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=64)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():  # routers start at zero in transformers' init: give them real preferences
        for r in moe_routers(model):
            r.weight.normal_(0, 1.0)
    return model


def _ids(rows=3, cols=7, seed=1):
    return torch.randint(1, 32, (rows, cols), generator=torch.Generator().manual_seed(seed))


def _record(model, ids):
    rec = RoutingRecorder(model)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    experts = rec.take()
    rec.remove()
    return logits, experts.reshape(ids.shape[0], ids.shape[1], *experts.shape[1:])


def test_shape_and_a_dense_model_has_none():
    model = _model(top_k=2, experts=4, layers=3)
    assert (routing_shape(model).layers, routing_shape(model).top_k, routing_shape(model).num_experts) == (3, 2, 4)
    dense = __import__("transformers").Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64,
                                                                   num_hidden_layers=1, num_attention_heads=2,
                                                                   num_key_value_heads=1))
    assert routing_shape(dense) is None and RoutingHooks.attach(dense, apply=True) is None


def test_replaying_the_models_own_choice_or_none_changes_nothing():
    model, ids = _model(), _ids()
    plain, own = _record(model, ids)
    hooks = RoutingHooks.attach(model, apply=True)
    with torch.no_grad(), hooks.replaying(own):
        same = model(input_ids=ids).logits
    with torch.no_grad(), hooks.replaying(torch.full_like(own, NO_EXPERT)):
        free = model(input_ids=ids).logits
    assert torch.equal(same, plain) and torch.equal(free, plain)


def test_forced_experts_compute_exactly_those_experts():
    """One MoE block, top-2 of 4: forcing experts (2, 0) on every token gives the experts' own computation with
    the router's softmax weights of exactly those two, renormalised; and the whole model's output moves."""
    model, ids = _model(top_k=2, experts=4, layers=1), _ids()
    plain, own = _record(model, ids)
    block = model.model.layers[0].mlp
    h = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    chosen = torch.tensor([[2, 0]] * 5)
    with torch.no_grad():
        probs = torch.softmax(h @ block.gate.weight.T, dim=-1).gather(1, chosen)
        expected = block.experts(h, chosen, probs / probs.sum(-1, keepdim=True))
        hooks = RoutingHooks.attach(block, apply=True)
        with hooks.replaying(chosen[:, None, :]):
            got = block(h[None])[0]
        hooks.remove()
    assert torch.allclose(got, expected, atol=1e-6)
    assert not torch.equal(own, torch.tensor([2, 0]).expand_as(own))  # the router itself chose otherwise somewhere
    model_hooks = RoutingHooks.attach(model, apply=True)
    with torch.no_grad(), model_hooks.replaying(torch.tensor([2, 0]).expand_as(own)):
        forced = model(input_ids=ids).logits
    assert not torch.allclose(forced, plain)


def test_gradient_reaches_the_router_under_replay():
    model, ids = _model(), _ids()
    _, own = _record(model, ids)
    hooks = RoutingHooks.attach(model, apply=True)
    model.train()
    with hooks.replaying(torch.roll(own, 1, dims=-1).flip(-1)):  # other experts on some tokens
        model(input_ids=ids).logits.pow(2).mean().backward()
    assert all(float(r.weight.grad.abs().sum()) > 0 for r in moe_routers(model))


def test_disagreement_and_load_counted_as_by_hand():
    model, ids = _model(top_k=1, experts=4, layers=2), _ids(rows=2, cols=5)
    _, own = _record(model, ids)  # [2, 5, 2, 1]
    given = own.clone()
    given[0, 1, 0, 0] = (given[0, 1, 0, 0] + 1) % 4  # 2 of the 20 (token, layer) pairs differ
    given[1, 3, 1, 0] = (given[1, 3, 1, 0] + 1) % 4
    given[1, 4] = NO_EXPERT  # 2 pairs without a record: not compared
    versions = torch.tensor([[5] * 5, [4] * 5])  # row 0 made at the learner's version 5: fresh
    hooks = RoutingHooks.attach(model, apply=False)  # measure: count, route itself
    hooks.counting, hooks.current_version = True, 5
    with torch.no_grad(), hooks.replaying(given, versions):
        logits = model(input_ids=ids).logits
    m = hooks.take_metrics()
    assert m["moe/routing_mismatch"] == pytest.approx(2 / 18)
    assert m["moe/routing_mismatch_fresh"] == pytest.approx(1 / 10)
    assert m["moe/routing_mismatch_stale"] == pytest.approx(1 / 8)
    assert torch.equal(logits, _record(model, ids)[0])  # measure never changes the forward
    forced = torch.zeros_like(own)  # every token on expert 0 of 4, top-1: the busiest expert holds 4x the mean
    hooks.apply = True
    with torch.no_grad(), hooks.replaying(forced):
        model(input_ids=ids)
    assert hooks.take_metrics()["moe/expert_load"] == pytest.approx(4.0)


def test_a_misaligned_or_misshapen_record_is_refused():
    model, ids = _model(), _ids()
    hooks = RoutingHooks.attach(model, apply=True)
    with pytest.raises(ValueError, match="MoE layers"):
        with hooks.replaying(torch.zeros(3, 7, 3, 2, dtype=torch.long)):
            pass
    with pytest.raises(RuntimeError, match="not aligned"):
        with torch.no_grad(), hooks.replaying(torch.zeros(3, 6, 2, 2, dtype=torch.long)):
            model(input_ids=ids)


def _family(name: str):
    """A tiny random model of a transformers MoE family (routers with real preferences)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(name, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, head_dim=16)
    for k, v in dict(moe_intermediate_size=32, num_experts=8, num_local_experts=8, n_routed_experts=8,
                     num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1).items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("family, supported", [("qwen3_moe", True), ("mixtral", True), ("glm4_moe", False),
                                               ("granitemoe", False)])
def test_check_replay_accepts_softmax_routers_and_names_the_others(family, supported):
    """A router found by its shape is replayed only if replaying the model's own choices leaves its logits alone:
    GLM-4.5's sigmoid scores with a bias (DeepSeek-V3's rule) would be given softmax weights, and Granite-MoE's
    router returns its outputs in another order; both are named, not trained wrongly."""
    from asyncppo.models.moe_routing import check_replay

    model = _family(family)
    hooks = RoutingHooks.attach(model, apply=True)
    assert hooks is not None
    problem = check_replay(model, hooks, 128)
    assert (problem is None) == supported, problem
    if not supported:
        assert problem.startswith("its routers cannot be replayed")
