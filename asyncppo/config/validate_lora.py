"""Checks of the LoRA options (``model.lora_*``, docs/lora.md).

Why these limits: the adapters are peft's on one learner rank (FSDP2 sharding of a peft model is not built), LLM runs
only (the embodied networks are small MLPs trained whole), and only linear projections inside the decoder: an
adapted embedding or output layer would change the tensors vLLM's CPU float32 path keeps a separate copy of for tied
embeddings (sync/engine_load.py), and a push would have to carry the whole matrix anyway.
"""

from __future__ import annotations

from asyncppo.config.checks import Checks
from asyncppo.config.devices import learner_ranks
from asyncppo.config.schema import AsyncPPOConfig

# module names that are embeddings or the output layer in the model families asyncppo loads
FORBIDDEN_TARGETS = ("embed_tokens", "lm_head", "wte", "wpe", "embed_out")


def check_lora(cfg: AsyncPPOConfig, c: Checks) -> None:
    m = cfg.model
    if not isinstance(m.lora_rank, int) or m.lora_rank < 0:
        c.error("model.lora_rank", m.lora_rank, "an int >= 0 (0: LoRA off, full fine-tuning)")
        return
    if m.lora_rank == 0:
        return
    if not m.lora_alpha > 0:
        c.error("model.lora_alpha", m.lora_alpha, "> 0 (the adapter update is scaled by lora_alpha / lora_rank)")
    if not 0.0 <= m.lora_dropout < 1.0:
        c.error("model.lora_dropout", m.lora_dropout, "in [0, 1)")
    targets = list(m.lora_target_modules or [])
    if not targets or any(not isinstance(t, str) or not t.strip() for t in targets):
        c.error("model.lora_target_modules", targets, "a non-empty list of module names (e.g. [q_proj, v_proj]) "
                "or [all-linear]")
    elif "all-linear" in targets and len(targets) > 1:
        c.error("model.lora_target_modules", targets, "all-linear stands alone: [all-linear] or a list of names")
    else:
        bad = [t for t in targets if t.split(".")[-1] in FORBIDDEN_TARGETS]
        if bad:
            c.error("model.lora_target_modules", targets, f"linear projections of the decoder layers only, not "
                    f"{bad} (embeddings and the output layer are trained whole or not at all under LoRA)")
    params = list(m.lora_target_parameters or [])
    if any(not isinstance(t, str) or not t.strip() for t in params):
        c.error("model.lora_target_parameters", params, "a list of parameter names (e.g. [mlp.experts.gate_up_proj, "
                "mlp.experts.down_proj]) or []")
    elif params and m.lora_dropout:
        c.error("model.lora_dropout", m.lora_dropout, "0 with model.lora_target_parameters (peft's parameter "
                "adapters cannot apply dropout to their input)")
    if cfg.env.id is not None:
        c.error("model.lora_rank", m.lora_rank, "0 for embodied runs (env.id is set): LoRA adapts language models")
    if learner_ranks(cfg) > 1:  # separate pools (cluster.train_gpus) or shared devices (--gpus N): one rank each
        where = (f"cluster.shared_gpus={cfg.cluster.shared_gpus}" if cfg.cluster.shared_gpus
                 else f"cluster.train_gpus={cfg.cluster.train_gpus}")
        c.error("model.lora_rank", m.lora_rank, f"0 with {where}: LoRA runs on one learner rank (FSDP2 sharding of "
                "the adapted model is not built); use --train-gpus 1 or --gpus 1")
