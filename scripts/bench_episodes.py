"""Multi-turn episodes through the real vLLM CPU engine: how much of each later turn's prefix the prefix cache
serves, by KV block size, with prefix caching on and off (asyncppo/envs/episodes.py).

A random tiny Qwen2 over the chat tokenizer of envs/chat.py; 4 groups of 8 episodes of a scripted 3-turn
environment (two fixed user replies, then done), 12 model tokens per turn at most, temperature 1.

    PYTHONPATH=$PWD python scripts/bench_episodes.py
"""

from __future__ import annotations

import os
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


class Scripted:
    """Replies twice with fixed text, ends on the third turn."""

    def __init__(self, env_config=None, extras=None):
        self.turns = 0

    def init(self, prompt_messages):
        return list(prompt_messages), {}

    def step(self, action_text):
        self.turns += 1
        if self.turns == 3:
            return [], 1.0, True, {}
        return [{"role": "user", "content": f"reply number {self.turns}, please go on"}], 0.0, False, {}


def build_model(out: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncppo.envs.chat import build_chat_tokenizer

    tok = build_chat_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).eval().save_pretrained(out)
    tok.save_pretrained(out)
    return tok


def run(path: str, tok, block_size: int, caching: bool) -> dict:
    from asyncppo.envs.env_runner import EnvRunner
    from asyncppo.envs.episodes import EpisodeEngine
    from asyncppo.rollout.engine import SamplingSpec
    from asyncppo.rollout.engines import make_engine

    eng = make_engine("vllm", path, dtype="float32", max_model_len=400, seed=0, kv_cache_gib=1, num_threads=1,
                      enable_prefix_caching=caching, block_size=block_size, disable_log_stats=False)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    t0, done = time.perf_counter(), 0
    with EnvRunner(max_concurrency=8, step_timeout_s=30) as runner:
        eps = EpisodeEngine(eng, tok, runner, max_turns=4, response_length=300, turn_max_tokens=12)
        for g in range(4):
            eps.add_group(f"g{g}", prompt, SamplingSpec(n=8, max_tokens=300, seed=100 * g),
                          [Scripted() for _ in range(8)])
        while done < 4:
            done += len(eps.step())
            if not eng.num_unfinished_seqs():
                time.sleep(0.002)
        eps.close()
    wall = time.perf_counter() - t0
    metrics = {m.name: m.value for m in eng.llm.get_metrics() if hasattr(m, "value")}
    eng.close()
    return {"block": block_size, "caching": caching, "prompt_tokens": int(metrics["vllm:prompt_tokens"]),
            "cached": int(metrics["vllm:prompt_tokens_cached"]), "turns": eps.counters["turns"], "wall_s": wall}


def main() -> None:
    path = tempfile.mkdtemp(prefix="episodes-bench-")
    tok = build_model(path)
    print("| KV block | prefix caching | prompt tokens | served from the cache | turns | wall s |")
    print("|---|---|---|---|---|---|")
    for block, caching in ((128, True), (32, True), (32, False)):
        r = run(path, tok, block, caching)
        print(f"| {r['block']} | {'on' if r['caching'] else 'off'} | {r['prompt_tokens']} | {r['cached']} "
              f"({r['cached'] / r['prompt_tokens']:.0%}) | {r['turns']} | {r['wall_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
