"""The memory split of one shared device (``--gpus N``): an engine and a learner rank side by side.

Pure arithmetic on the model's shape and the options, so ``--dry-run`` shows it in milliseconds, an impossible split
is refused before anything starts, and tests check it with numbers worked out by hand. The rules of thumb
(docs/quickstart-gpu.md repeats them):

* the engine owns ``rollout.gpu_memory_utilization`` x the device: its weights in ``rollout.dtype``, a workspace for
  its forward passes (:data:`ENGINE_WORKSPACE_GIB`), and the KV cache in the rest (vLLM sizes its cache the same way:
  whatever its share leaves after weights and a profiled forward);
* the learner works in the rest, less one CUDA context per process (:data:`CONTEXT_GIB`): the actor's weights and
  gradients in ``model.dtype``, AdamW's two moments (torch keeps them in the parameter's dtype, so 2 x its bytes),
  the same three again for a critic, the frozen reference's weights, and the activations of one micro-batch;
* activations of ``T`` tokens: ``T x layers x (10 x hidden + 3 x intermediate)`` values in ``model.dtype`` (attention
  inputs, norms and residuals, the MLP's gate/up/act), ``T x hidden`` per layer instead with gradient checkpointing
  plus one layer recomputed, and ``3 x T x vocab x 4`` bytes for the float32 logits, log-softmax and its gradient.

The estimates are deliberately simple: they say whether a split is plausible and which option to move, not the
allocator's peak to the megabyte.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

GIB = float(1 << 30)
CONTEXT_GIB = 0.5  # one CUDA context and allocator reserve per process
ENGINE_WORKSPACE_GIB = 1.0  # the engine's forward activations and sampler buffers beside weights and KV cache
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the memory depends on, in a Qwen2 / Llama shaped decoder (``config.json`` names)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    qkv_bias: bool = True  # Qwen2 has q/k/v biases, Llama none

    def params(self) -> int:
        """Parameter count: embeddings, attention (q, k, v, o), gated MLP, two norms per layer, final norm, head."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        q_out = self.heads * self.head_dim
        attn = h * q_out + 2 * h * kv + q_out * h + ((q_out + 2 * kv) if self.qkv_bias else 0)
        per_layer = attn + 3 * h * self.intermediate + 2 * h
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.layers * per_layer + h + head

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of each linear projection of one decoder layer, by its Hugging Face module name."""
        h, kv, q_out, mlp = self.hidden, self.kv_heads * self.head_dim, self.heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q_out), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q_out, h),
                "gate_proj": (h, mlp), "up_proj": (h, mlp), "down_proj": (mlp, h)}

    def adapter_params(self, rank: int, targets: list[str]) -> int:
        """LoRA's trainable parameters: ``rank x (in + out)`` per adapted projection and layer (A is r x in, B out x r)."""
        shapes = self.linear_shapes()
        names = list(shapes) if "all-linear" in targets else [t for t in targets if t in shapes]
        return self.layers * sum(rank * (shapes[n][0] + shapes[n][1]) for n in names)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """One token's keys and values in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def attention_dims(config: dict) -> tuple[int, int, int]:
    """``(heads, kv_heads, head_dim)`` from a Hugging Face ``config.json`` dictionary (grouped-query attention:
    ``num_key_value_heads`` defaults to the heads; ``head_dim`` to hidden / heads)."""
    heads = int(config["num_attention_heads"])
    return heads, int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or
                                                                      int(config["hidden_size"]) // heads)


def shape_from_config(config: dict) -> ModelShape:
    """A :class:`ModelShape` from a Hugging Face ``config.json`` dictionary."""
    heads, kv_heads, head_dim = attention_dims(config)
    return ModelShape(
        vocab=int(config["vocab_size"]), hidden=int(config["hidden_size"]), layers=int(config["num_hidden_layers"]),
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=int(config["intermediate_size"]),
        tied=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
    )


@dataclasses.dataclass(frozen=True)
class LearnerLoad:
    """What the learner rank keeps on the device."""

    dtype_bytes: int  # model.dtype
    optimizer_bytes_per_param: int  # AdamW's two moments
    critic: bool
    reference: bool
    micro_batch_tokens: int
    gradient_checkpointing: bool = False
    adapter_params: int = 0  # LoRA (model.lora_rank > 0): only these train; peft keeps them, their grads and moments in fp32


@dataclasses.dataclass(frozen=True)
class MemorySplit:
    """One device, in GiB (``kv_tokens`` in tokens); ``problem`` is empty when the split fits."""

    device: float
    utilization: float
    engine: float
    engine_weights: float
    kv_cache: float
    kv_tokens: int
    learner_budget: float
    weights: float
    gradients: float
    optimizer: float
    critic: float
    reference: float
    activations: float
    learner_total: float
    max_utilization: float  # the largest rollout.gpu_memory_utilization that leaves the learner its estimate
    problem: str = ""

    def lines(self) -> list[str]:
        """What ``--dry-run`` prints under the placement table."""
        return [
            f"memory of one shared device: {self.device:.2f} GiB; engine {self.engine:.2f} GiB "
            f"(rollout.gpu_memory_utilization={self.utilization:g}), learner {self.learner_budget:.2f} GiB after "
            f"{2 * CONTEXT_GIB:g} GiB of CUDA contexts",
            f"  engine:  weights {self.engine_weights:.2f} + workspace {ENGINE_WORKSPACE_GIB:g} + KV cache "
            f"{self.kv_cache:.2f} GiB (~{self.kv_tokens} tokens)",
            f"  learner: weights {self.weights:.2f} + gradients {self.gradients:.2f} + AdamW {self.optimizer:.2f} + "
            f"critic {self.critic:.2f} + reference {self.reference:.2f} + activations {self.activations:.2f} = "
            f"{self.learner_total:.2f} GiB (fits up to rollout.gpu_memory_utilization={self.max_utilization:.2f})",
        ]


def activation_bytes(shape: ModelShape, tokens: int, dtype_bytes: int, checkpointing: bool) -> int:
    """One micro-batch's activations (module docstring)."""
    block = 10 * shape.hidden + 3 * shape.intermediate
    kept = shape.layers * shape.hidden + block if checkpointing else shape.layers * block
    return tokens * kept * dtype_bytes + 3 * tokens * shape.vocab * 4


def split_memory(shape: ModelShape, device_bytes: float, utilization: float, engine_dtype_bytes: int,
                 load: LearnerLoad) -> MemorySplit:
    """The split of one device between an engine at ``utilization`` and a learner rank carrying ``load``."""
    params = shape.params()
    engine = utilization * device_bytes
    engine_weights = params * engine_dtype_bytes
    kv = engine - engine_weights - ENGINE_WORKSPACE_GIB * GIB
    weights = params * load.dtype_bytes
    full_trio = weights + weights + params * load.optimizer_bytes_per_param  # weights, gradients, AdamW moments
    if load.adapter_params:  # the frozen base, then the adapters with their gradients and two moments, all fp32
        gradients, optimizer = load.adapter_params * 4, load.adapter_params * 8
        trio = weights + load.adapter_params * 4 + gradients + optimizer
    else:
        gradients, optimizer = weights, params * load.optimizer_bytes_per_param
        trio = full_trio
    critic = full_trio if load.critic else 0
    reference = weights if load.reference else 0
    act = activation_bytes(shape, load.micro_batch_tokens, load.dtype_bytes, load.gradient_checkpointing)
    total = trio + critic + reference + act
    budget = device_bytes - engine - 2 * CONTEXT_GIB * GIB
    max_util = (device_bytes - 2 * CONTEXT_GIB * GIB - total) / device_bytes
    split = MemorySplit(
        device=device_bytes / GIB, utilization=utilization, engine=engine / GIB, engine_weights=engine_weights / GIB,
        kv_cache=max(kv, 0) / GIB, kv_tokens=max(int(kv // shape.kv_bytes_per_token(engine_dtype_bytes)), 0),
        learner_budget=budget / GIB, weights=weights / GIB, gradients=gradients / GIB,
        optimizer=optimizer / GIB, critic=critic / GIB, reference=reference / GIB,
        activations=act / GIB, learner_total=total / GIB, max_utilization=max_util)
    return dataclasses.replace(split, problem=_problem(split, kv))


def _problem(s: MemorySplit, kv_bytes: float) -> str:
    """Why the split cannot work, naming the option to change ("" when it fits)."""
    if s.learner_total > s.learner_budget:
        fix = (f"lower rollout.gpu_memory_utilization to {s.max_utilization:.2f} or less" if s.max_utilization > 0
               else "the learner alone does not fit this device: shrink its activations "
                    "(model.gradient_checkpointing=true, a smaller algorithm.micro_batch_size), use "
                    "model.dtype=bfloat16 if it is float32, or separate pools (--rollout-gpus/--train-gpus)")
        return (f"the learner needs about {s.learner_total:.2f} GiB but only {s.learner_budget:.2f} GiB of the "
                f"{s.device:.2f} GiB device are left beside the engine (rollout.gpu_memory_utilization="
                f"{s.utilization:g}): {fix}")
    if kv_bytes <= 0:
        return (f"the engine's share ({s.engine:.2f} GiB at rollout.gpu_memory_utilization={s.utilization:g}) "
                f"leaves no KV cache after its weights ({s.engine_weights:.2f} GiB) and workspace: raise "
                f"rollout.gpu_memory_utilization (the learner fits up to {s.max_utilization:.2f})")
    return ""


def micro_batch_tokens(micro_rows: int, max_tokens: int, sequence_tokens: int) -> int:
    """Tokens in one learner micro-batch: the token budget when set, else rows x the longest sequence."""
    return max_tokens if max_tokens > 0 else micro_rows * sequence_tokens


def optimizer_bytes(dtype_bytes: int) -> int:
    """AdamW's exp_avg and exp_avg_sq, which torch allocates in the parameter's dtype."""
    return 2 * dtype_bytes


def describe_unknown(reason: Optional[str]) -> list[str]:
    """The line printed when no split can be computed (unknown device memory or model shape)."""
    return [f"memory of one shared device: not estimated ({reason})"]
