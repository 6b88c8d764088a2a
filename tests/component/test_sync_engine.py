"""End to end: the learner process pushes new weights to a real vLLM CPU engine running in another process.

The engine's greedy output must equal transformers' greedy output with the old weights before the push and with
the new weights after it. The pushes go through small buckets and the loader flushes in layer groups, so the
engine is loaded by several partial ``reload_weights`` calls: the case that goes wrong if a fused vLLM layer
were split across calls.
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

import engine_reference

from asyncppo.sync import UnsupportedWeightSync, WeightSender, find_free_port, make_sync_group, tied_alias_name

PROMPTS = ["12+34=", "7+8=", "99+1=", "5+55="]
NEW_TOKENS = 6
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def build_model(out_dir: str, tie: bool) -> str:
    """The project's tiny Qwen2 when available, else an equivalent one built here."""
    try:
        from asyncppo.data.tiny import build_tiny_model
    except ImportError:
        build_tiny_model = None
    if build_tiny_model is not None:
        return build_tiny_model(out_dir, tie_word_embeddings=tie, seed=0)
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789+="])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    cfg = Qwen2Config(vocab_size=len(vocab), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                      tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def hf_greedy(model, tokenizer) -> list[list[int]]:
    return engine_reference.hf_greedy(model, tokenizer, PROMPTS, NEW_TOKENS)


class _Engine:
    """The project's vLLM engine when it exists (else a bare ``vllm.LLM``), recording each weight-load call."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.calls: list[list[str]] = []
        try:
            from asyncppo.rollout.vllm_engine import VLLMEngine
        except ImportError:
            VLLMEngine = None
        if VLLMEngine is not None:
            # allow_tied_fp32: this path pushes lm_head.weight explicitly, which is what makes tied fp32 correct
            self.engine = VLLMEngine(model_dir, dtype="float32", max_model_len=64, seed=0, allow_tied_fp32=True)
            self.llm = self.engine.llm
        else:
            from vllm import LLM

            self.engine, self.llm = None, LLM(model=model_dir, dtype="float32", max_model_len=64,
                                              enforce_eager=True, seed=0)

    def greedy(self) -> list[list[int]]:
        prompts = [self.tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
        if self.engine is not None:
            outs = self.engine.generate(prompts, n=1, max_tokens=NEW_TOKENS, temperature=0.0)
            return [[int(t) for t in o[0].token_ids] for o in outs]
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def update_weights(self, named):
        from asyncppo.sync import vllm_reload_weights

        named = list(named)
        self.calls.append(sorted({n.split(".")[2] if n.startswith("model.layers.") else n for n, _ in named}))
        if self.engine is not None:
            self.engine.update_weights(named)
        else:
            vllm_reload_weights(self.llm, named, quiet_partial=True)


def _engine_process(model_dir: str, port: int, q) -> None:
    try:
        os.environ.update(VLLM_ENV)
        from asyncppo.sync import LayerGroupLoader, WeightReceiver

        engine = _Engine(model_dir)
        before = engine.greedy()
        group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=120)
        rx = WeightReceiver(group)
        loader = LayerGroupLoader(engine, flush_bytes=300_000, model_config=model_dir, dtype="float32")
        version = loader.receive(rx)
        after = engine.greedy()
        group.close()
        q.put({"before": before, "after": after, "version": version, "calls": engine.calls,
               "max_bucket": rx.stats.max_bucket_bytes, "rx_version": rx.version})
    except BaseException as e:
        import traceback

        q.put({"error": "".join(traceback.format_exception(e))})


def _push_and_compare(tmp_path, tie: bool, push_items):
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model_dir = build_model(str(tmp_path / "model"), tie=tie)
    port = find_free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_engine_process, args=(model_dir, port, q), daemon=True)
    proc.start()
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        old, new = engine_reference.perturb_changing_greedy(model, tok, PROMPTS, NEW_TOKENS)
        group = make_sync_group("127.0.0.1", port, 0, 2, timeout_s=120)
        sender = WeightSender(group, bucket_bytes=64 << 10)
        stats = sender.push(push_items(model), version=1)
        res = q.get(timeout=120)
        group.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert "error" not in res, res.get("error")
    assert res["before"] == old
    assert res["after"] == new
    assert res["version"] == 1 and res["rx_version"] == 1
    assert stats.max_bucket_bytes <= 64 << 10 and res["max_bucket"] <= 64 << 10
    return res


def test_push_updates_a_running_vllm_engine_layer_group_by_layer_group(tmp_path):
    res = _push_and_compare(tmp_path, tie=False, push_items=lambda m: m.state_dict())
    # several partial reloads, each with whole layers only (a decoder layer is never split across calls)
    assert len(res["calls"]) >= 2, res["calls"]
    seen = [x for call in res["calls"] for x in call]
    assert len(seen) == len(set(seen)), res["calls"]


def test_tied_float32_model_gets_its_output_layer_updated(tmp_path):
    # named_parameters() of a tied model omits lm_head.weight: exactly the push vLLM's fp32 CPU reload mishandles
    assert tied_alias_name({"tie_word_embeddings": True}, "float32") == "lm_head.weight"
    res = _push_and_compare(tmp_path, tie=True, push_items=lambda m: list(m.named_parameters()))
    assert any("lm_head.weight" in call for call in res["calls"]), res["calls"]


def test_tied_detection_rules(tmp_path):
    assert tied_alias_name({"tie_word_embeddings": False}, "float32") is None
    assert tied_alias_name({"tie_word_embeddings": True}, "bfloat16") is None
    assert tied_alias_name({"tie_word_embeddings": True}, torch.float32) == "lm_head.weight"
    assert tied_alias_name({"tie_word_embeddings": True, "torch_dtype": "float32"}, "auto") == "lm_head.weight"
    assert tied_alias_name({"tie_word_embeddings": True}, "float32", device="cuda") is None
    assert tied_alias_name({}, "float32") == "lm_head.weight"  # unknown counts as tied

    from asyncppo.sync import LayerGroupLoader
    from asyncppo.sync.layout import Header, TensorMeta

    loader = LayerGroupLoader(engine=None, model_config={"tie_word_embeddings": True}, dtype="float32")
    with pytest.raises(UnsupportedWeightSync, match="neither 'lm_head.weight' nor a known embedding name"):
        loader.on_header(Header(1, 1024, (TensorMeta("encoder.tok.weight", "float32", (4, 2)),)))
