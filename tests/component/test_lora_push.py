"""A LoRA push end to end: the learner broadcasts adapter tensors only (real gloo), and a vLLM engine and a transformers
engine in another process merge them onto their base weights and generate what the merged model generates.

What it pins down (docs/lora.md):
* the push's bytes: exactly ``4 * r * (in + out)`` summed over the adapted projections, against the full push's
  ``4 *`` (every parameter), both computed here from the model's shapes, not read back from the code under test;
* the engines generate with the pushed adapter: greedy output equals transformers' greedy of peft's own
  ``merge_and_unload`` (independent of asyncppo's merge);
* a second adapter merges onto the base, not onto the first merge; a later full push still loads as before.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os

import torch

import engine_reference

from asyncppo.config.schema import ModelConfig
from asyncppo.sync import WeightSender, find_free_port, make_sync_group

PROMPTS = ["12+34=", "7+8=", "99+1=", "5+55=", "40+2=", "3+61="]
NEW_TOKENS = 6
RANK, ALPHA = 4, 8.0
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


class _Both:
    """One loader target feeding two engines the same tensors."""

    def __init__(self, *engines):
        self.engines = engines

    def update_weights(self, named):
        named = list(named)
        for e in self.engines:
            e.update_weights(named)


def _engine_process(model_dir: str, port: int, q) -> None:
    try:
        os.environ.update(VLLM_ENV)
        from transformers import AutoTokenizer

        from asyncppo.rollout.engines import make_engine
        from asyncppo.sync import LayerGroupLoader, WeightReceiver
        from asyncppo.sync.adapter import AdapterMerger

        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
        engines = {kind: make_engine(kind, model_dir, dtype="float32", max_model_len=64, seed=0, device="cpu")
                   for kind in ("vllm", "hf")}

        def greedy():
            return {k: [[int(t) for t in o[0].token_ids] for o in e.generate(prompts, n=1, max_tokens=NEW_TOKENS,
                                                                             temperature=0.0)]
                    for k, e in engines.items()}

        merged = _Both(*(AdapterMerger(e, model_dir, ALPHA / RANK) for e in engines.values()))
        group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=120)
        rx = WeightReceiver(group)
        out = {"base": greedy()}
        for step in ("v1", "v2"):  # adapters, merged onto the base (small flushes: several merge calls)
            LayerGroupLoader(merged, flush_bytes=20_000, model_config=None).receive(rx)
            out[step] = greedy()
        LayerGroupLoader(_Both(*engines.values()), model_config=model_dir, dtype="float32").receive(rx)  # full push
        out["full"] = greedy()
        group.close()
        q.put(out)
    except BaseException as e:
        import traceback

        q.put({"error": "".join(traceback.format_exception(e))})


def _shape_counts(config) -> tuple[int, int]:
    """(adapter parameters at RANK on every linear projection, every parameter of the untied model)."""
    h, inter, L, V = config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.vocab_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    projections = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]  # (in, out)
    adapter = L * sum(RANK * (i + o) for i, o in projections)
    layer = sum(i * o for i, o in projections) + q + 2 * kv + 2 * h  # weights, q/k/v biases, two RMSNorms
    return adapter, 2 * V * h + L * layer + h  # embeddings, output layer, layers, final norm


def _adapted(model_dir: str, seed: int):
    from asyncppo.learner.lora import lora_actor
    from asyncppo.learner.models import load_actor

    torch.manual_seed(seed)
    model = lora_actor(load_actor(model_dir, torch.float32, torch.device("cpu")),
                       ModelConfig(lora_rank=RANK, lora_alpha=ALPHA))
    with torch.no_grad():  # adapters large enough to change the greedy answers
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.35 * torch.randn_like(p))
    return model


def test_adapter_push_bytes_and_engines_generate_with_the_merged_adapter(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from asyncppo.data.tiny import build_tiny_model
    from asyncppo.learner.lora import adapter_tensors
    from asyncppo.learner.models import full_state_dict

    model_dir = build_tiny_model(str(tmp_path / "model"), seed=0)  # the built-in shape, untied, float32
    port = find_free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_engine_process, args=(model_dir, port, q), daemon=True)
    proc.start()
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        first, second = _adapted(model_dir, 1), _adapted(model_dir, 2)
        group = make_sync_group("127.0.0.1", port, 0, 2, timeout_s=120)
        sender = WeightSender(group, bucket_bytes=64 << 10)
        stats = [sender.push(adapter_tensors(first), version=1), sender.push(adapter_tensors(second), version=2)]
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        stats.append(sender.push(full_state_dict(base), version=3))
        res = q.get(timeout=240)
        group.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert "error" not in res, res.get("error")
    adapter, full = _shape_counts(AutoConfig.from_pretrained(model_dir))
    assert stats[0].payload_bytes == stats[1].payload_bytes == 4 * adapter
    assert stats[2].payload_bytes == 4 * full
    print(f"push bytes: adapters (r={RANK}) {stats[0].payload_bytes} / full {stats[2].payload_bytes} = "
          f"{stats[0].payload_bytes / stats[2].payload_bytes:.5f} (= {adapter} / {full} parameters)")

    want = {"base": engine_reference.hf_greedy(base, tok, PROMPTS, NEW_TOKENS)}
    for step, model in (("v1", first), ("v2", second)):
        want[step] = engine_reference.hf_greedy(copy.deepcopy(model).merge_and_unload().eval(), tok, PROMPTS,
                                                NEW_TOKENS)
    assert want["v1"] != want["base"] and want["v2"] != want["v1"]  # every push changes what the engine must say
    for step in ("base", "v1", "v2"):
        assert res[step]["vllm"] == want[step], step
        assert res[step]["hf"] == want[step], step
    assert res["full"]["vllm"] == res["full"]["hf"] == want["base"]  # a full push after adapters still loads
