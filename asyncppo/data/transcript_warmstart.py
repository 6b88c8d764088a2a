"""Supervised warm start on multi-turn transcripts (the built-in chat tasks, e.g. ``data=calculator``).

Why a second warm start beside :func:`asyncppo.data.warmstart.supervised_warmstart`: a transcript has several
trained spans (each assistant turn and its ``<|im_end|>``) between context the model must read but not learn to
write (the system turn with the tools, the user's question, the tool's result). The loss covers the assistant
spans only, as the episodes' loss mask will. The task decides what the transcripts teach; for the calculator, a
share of them calls the tool and the rest answers in the head, so that the starting policy sometimes takes the
path that works and reinforcement learning has a clear choice to sharpen.

Two phases. Copying the question's digits into the call, and the tool's result into the answer, is a skill the
tiny model acquires abruptly (its loss falls from ~0.4 to ~0.02 within a few dozen steps, measured after ~250
steps of 32 transcripts) and the tools' system turn is two thirds of every full transcript. So the *copy phase*
trains on tool-path transcripts without the system turn (~100 tokens instead of ~340: the same relative
positions under RoPE, at a third of the cost), then the *task phase* on full transcripts with the tool share.
"""

from __future__ import annotations

import random
import time

import torch

from .warmstart import _encode_many, sft_loss


def encode_transcripts(tokenizer, transcripts: list[list[tuple[str, bool]]]):
    """Right-padded ``input_ids``, ``attention_mask`` and a ``loss_mask`` that is 1 on the trained segments' tokens.

    Segments are encoded one by one and concatenated: with a char-level tokenizer whose special tokens never span a
    segment boundary this equals encoding the whole text, and it tells each token's segment without offsets."""
    flat = [text for segments in transcripts for text, _ in segments]
    encoded = iter(_encode_many(tokenizer, flat))
    seqs, masks = [], []
    for segments in transcripts:
        ids, mask = [], []
        for _, trained in segments:
            part = next(encoded)
            ids += part
            mask += [int(trained)] * len(part)
        seqs.append(ids)
        masks.append(mask)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    return ids, attn, loss_mask


def transcript_warmstart(model_dir: str, task, *, steps: int = 150, batch_size: int = 16, lr: float = 2e-3,
                         copy_steps: int = 400, copy_batch_size: int = 32, seed: int = 0, pool: int = 4096,
                         tool_share: float = 0.4, num_threads: int = 1, verbose: bool = True) -> dict:
    """Train the model in ``model_dir`` in place: ``copy_steps`` steps of ``copy_batch_size`` tool-path transcripts
    without the system turn, then ``steps`` steps of ``batch_size`` full transcripts, a ``tool_share`` of them on
    the tool path (``task.warmstart_transcripts``); return the losses and timings.

    ``pool``: each phase's transcripts are rendered once (the chat template costs about a millisecond each) and
    batches are drawn from them. ``num_threads``: one, as the single-turn warm start measured on two shared cores."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    report = {"tool_share": tool_share, "pool": pool}
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            model.train()
            for phase, n, size, share, tools in (("copy", copy_steps, copy_batch_size, 1.0, False),
                                                 ("task", steps, batch_size, tool_share, True)):
                if n <= 0:
                    continue
                t0 = time.time()
                batches = encode_transcripts(tokenizer, task.warmstart_transcripts(tokenizer, pool, rng, share,
                                                                                   with_tools=tools))
                loss = _train(model, opt, batches, n, size, rng, f"{phase} phase" if verbose else None)
                report[phase] = {"steps": n, "batch_size": size, "final_loss": loss, "s": round(time.time() - t0, 1)}
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(model_dir, safe_serialization=True)
    return report


def _train(model, opt, batches, steps: int, batch_size: int, rng: random.Random, label) -> float:
    """``steps`` optimizer steps on random batches of the encoded transcripts; the last step's loss."""
    all_ids, all_attn, all_mask = batches
    lengths = all_attn.sum(-1)
    loss, t0 = float("nan"), time.time()
    for step in range(1, steps + 1):
        idx = torch.tensor(rng.sample(range(len(lengths)), batch_size))
        width = int(lengths[idx].max())
        opt.zero_grad(set_to_none=True)
        out = sft_loss(model, all_ids[idx, :width], all_attn[idx, :width], all_mask[idx, :width])
        out.backward()
        opt.step()
        loss = out.item()
        if label and (step % 50 == 0 or step == steps):
            print(f"[asyncppo] transcript warm start, {label}: step {step}/{steps} loss {loss:.3f} "
                  f"({time.time() - t0:.1f}s)", flush=True)
    return loss
