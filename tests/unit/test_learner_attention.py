"""``model.attn_implementation``: the learner's attention kernel, which packing reads back to size its rows, and
the checks around it; and the self-test's learner-variants rung, which names every variant that fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.config.validate import check_config
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.forward import policy_forward
from asyncppo.learner.models import load_actor, load_critic
from asyncppo.learner.packing import LONGEST, pack_capacity, uses_varlen_attention
from asyncppo.selftest import rungs_variants
from asyncppo.selftest.ladder import Context
from asyncppo.stream.records import Sample, TrajectoryGroup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, heads=2, intermediate=128, seed=7)


def _errors(**model) -> list[str]:
    cfg = AsyncPPOConfig()
    for key, value in model.items():
        if key == "train_gpus":
            cfg.cluster.train_gpus = value
        else:
            setattr(cfg.model, key, value)
    return check_config(cfg)[0]


def test_the_option_is_checked_by_name():
    assert _errors() == [] and _errors(attn_implementation="sdpa") == [] and _errors(attn_implementation="eager") == []
    (unknown,) = _errors(attn_implementation="flash")
    assert "model.attn_implementation" in unknown and "flex_attention" in unknown  # the allowed values are listed
    (cpu,) = _errors(attn_implementation="flex_attention")  # a CPU learner: torch has no flex backward there
    assert "model.attn_implementation" in cpu and "CPU" in cpu
    assert _errors(attn_implementation="flex_attention", train_gpus=1) == []


def test_the_kernel_reaches_every_learner_model_and_sizes_the_packed_rows(model_dir):
    cpu = torch.device("cpu")
    eager = load_actor(model_dir, torch.float32, cpu, attn_implementation="eager")
    assert eager.config._attn_implementation == "eager"
    assert load_critic(model_dir, torch.float32, cpu, attn_implementation="eager").body.config._attn_implementation \
        == "eager"
    default = load_actor(model_dir, torch.float32, cpu)
    assert default.config._attn_implementation == "sdpa"  # null leaves transformers' own choice
    flex = load_actor(model_dir, torch.float32, cpu, attn_implementation="flex_attention")  # loads; trains on CUDA
    cfg = AsyncPPOConfig().algorithm
    cfg.max_tokens_per_micro_batch, cfg.pack_sequences = 4096, True
    assert not uses_varlen_attention(eager) and not uses_varlen_attention(default)
    assert pack_capacity(cfg, uses_varlen_attention(default)) == LONGEST  # mask path: rows as wide as the longest
    assert uses_varlen_attention(flex)  # a block mask skips the blocks outside every sequence
    assert pack_capacity(cfg, uses_varlen_attention(flex)) == 4096  # rows filled up to the budget


def test_eager_and_sdpa_packed_forwards_agree(model_dir):
    """The kernel changes the work, not the numbers: packed log-probs under eager equal sdpa's."""
    rng = np.random.default_rng(0)
    groups = [TrajectoryGroup(group_id=f"0-{g}", worker_id=0, prompt_ids=rng.integers(4, 16, size=5).astype(np.int32),
                              samples=[Sample(response_ids=rng.integers(4, 16, size=n).astype(np.int32),
                                              behavior_logprobs=np.zeros(n, np.float32), reward=1.0,
                                              finish_reason="stop", version_min=0, version_max=0)
                                       for n in (3, 17, 40)]) for g in range(2)]
    batch = collate_groups(groups, 0)
    batch.pack_capacity = LONGEST
    out = [policy_forward(load_actor(model_dir, torch.float64, torch.device("cpu"), attn_implementation=impl),
                          batch, 1.0, False)[0] for impl in ("sdpa", "eager")]
    torch.testing.assert_close(out[1], out[0], rtol=1e-6, atol=1e-6)  # logits are cast to float32


def test_the_variants_rung_names_each_failing_variant(monkeypatch, tmp_path):
    monkeypatch.setattr(rungs_variants, "VARIANTS", [
        ("grpo", {"adv_estimator": "grpo"}),
        ("bad loss", {"adv_estimator": "grpo", "policy_loss": "no_such_loss"}),
        ("gae", {"adv_estimator": "gae"}),
    ])
    with pytest.raises(RuntimeError, match=r"1 of 3 variants failed: bad loss: .*no_such_loss"):
        rungs_variants.learner_variants(Context(device="cpu", out_dir=str(tmp_path)))
    monkeypatch.setattr(rungs_variants, "VARIANTS", [("grpo", {"adv_estimator": "grpo"})])
    assert rungs_variants.learner_variants(Context(device="cpu", out_dir=str(tmp_path)))["passed"] == 1
