"""Supervised warm start of a freshly built model on a synthetic task, plus a small accuracy probe.

A randomly initialised policy almost never produces a correct answer, so PPO would see zero reward and learn
nothing. A few hundred supervised steps (loss on answer tokens only) bring sampled accuracy to roughly a
quarter: low enough that RL has room to improve it visibly, high enough that rewards are not all zero.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """``tokenizer.encode(t, add_special_tokens=False)`` for every text, through the fast backend in one batch when
    there is one: the per-call overhead of the transformers wrapper made 40,000 short encodes take ~9 s (~1 s)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def encode_rows(tokenizer, rows: list[dict], with_answer: bool = True):
    """Right-padded ``input_ids``, ``attention_mask`` and a ``loss_mask`` over answer tokens and the final eos."""
    prompts = _encode_many(tokenizer, [r["prompt"] for r in rows])
    answers = _encode_many(tokenizer, [r["answer"] for r in rows]) if with_answer else [[] for _ in rows]
    eos = [tokenizer.eos_token_id] if with_answer else []
    seqs = [p + a + eos for p, a in zip(prompts, answers)]
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], dtype=torch.long)
    attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    loss_mask = torch.tensor([[0] * len(p) + [1] * (len(s) - len(p)) + [0] * (width - len(s))
                              for p, s in zip(prompts, seqs)], dtype=torch.float32)
    return ids, attn, loss_mask


def sft_loss(model, ids, attn, loss_mask) -> torch.Tensor:
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    targets = ids[:, 1:]
    mask = loss_mask[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return (nll.view_as(mask) * mask).sum() / mask.sum().clamp_min(1.0)


@torch.no_grad()
def answer_accuracy(model, tokenizer, rows: list[dict], *, temperature: float, seed: int = 0, max_new_tokens: int = 5):
    """Fraction of ``rows`` whose generated answer (up to eos, within ``max_new_tokens``) equals the reference.

    Prompts are left-padded (position ids skip the padding) and decoded with the KV cache, one token per step for
    the whole batch; ``temperature == 0`` is greedy. ``max_new_tokens`` must cover the longest answer plus eos:
    pass the task's ``max_response_tokens`` (5 suits two-digit addition, the default; reversal needs
    ``max_len + 1``). The cache matters for long answers: without it each step re-ran the whole prefix, and 512
    rows of the reverse task took ~70 s instead of a few.
    """
    model.eval()
    ids, attn, _ = _left_padded_prompts(tokenizer, rows)
    gen = torch.Generator().manual_seed(seed)
    done = torch.zeros(len(rows), dtype=torch.bool)
    out = [[] for _ in rows]
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    past = None
    for _ in range(max_new_tokens):
        res = model(input_ids=ids, attention_mask=attn, position_ids=pos, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[:, -1].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        else:
            nxt = logits.argmax(-1)
        for i in range(len(rows)):
            if not done[i]:
                if int(nxt[i]) == tokenizer.eos_token_id:
                    done[i] = True
                else:
                    out[i].append(int(nxt[i]))
        if bool(done.all()):
            break
        ids = nxt[:, None]
        pos = pos[:, -1:] + 1
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
    texts = [tokenizer.decode(o) for o in out]
    correct = sum(int(t.strip() == r["answer"] and bool(d)) for t, r, d in zip(texts, rows, done.tolist()))
    return correct / max(1, len(rows))


def _bucketed_step(model, all_ids, all_attn, all_mask, idx, lengths, buckets: int) -> float:
    """Accumulate the gradient of one batch's answer-token-mean loss over length-sorted micro-batches."""
    idx = idx[torch.argsort(lengths[idx], stable=True)]
    total = all_mask[idx][:, 1:].sum().clamp_min(1.0)
    loss = 0.0
    for chunk in torch.tensor_split(idx, buckets):
        if len(chunk) == 0:
            continue
        w = int(lengths[chunk].max())
        ids, attn, mask = all_ids[chunk, :w], all_attn[chunk, :w], all_mask[chunk, :w]
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none")
        part = (nll.view_as(mask[:, 1:]) * mask[:, 1:]).sum() / total
        part.backward()
        loss += part.item()
    return loss


def _left_padded_prompts(tokenizer, rows):
    enc = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(enc), width), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, width - len(e) :] = torch.tensor(e)
        attn[i, width - len(e) :] = 1
    return ids, attn, None


def supervised_warmstart(
    model_dir: str,
    task,
    *,
    steps: int = 300,
    batch_size: int = 128,
    lr: float = 1e-3,
    seed: int = 0,
    eval_rows: int = 256,
    verbose: bool = True,
    num_threads: int = 1,
    length_buckets: int = 1,
    max_answer_chars: int = 0,
) -> dict:
    """Train the model in ``model_dir`` in place on the task's train split; return timings and accuracies.

    ``num_threads`` (default 1): on two shared cores a second intra-op thread made each step 5-10x *slower*
    (0.1 s -> 0.5-1 s measured while other processes were busy): this model is too small to split.

    ``length_buckets`` (default 1: one forward per step): with variable-length rows (the reverse task), each
    step's batch is sorted by length and run as this many micro-batches, each cut to its own longest row, with
    the loss summed over all answer tokens and divided once by their count: the same gradient as one padded
    batch, without computing a long-tail row's width for every short row.

    ``max_answer_chars`` (0: every row): train only on rows whose answer is at most this long. For the ``long``
    task each step of the working is learnt from short rows, and a batch holding a 1,000-token row cost ~4x more
    per step; the long rows stay for RL, and the held-out probes still cover every length.

    The held-out accuracy probes generate up to the task's ``max_response_tokens`` (5 when it has none).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    splits = task.splits()
    train, held_out = splits.train, splits.eval[:eval_rows]
    if max_answer_chars > 0:
        train = [r for r in train if len(r["answer"]) <= max_answer_chars]
    all_ids, all_attn, all_mask = encode_rows(tokenizer, train)  # tokenise once; batches are index lookups
    lengths = all_attn.sum(-1)
    max_new_tokens = int(getattr(task, "max_response_tokens", 5))
    rng = random.Random(seed)
    threads = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            t0 = time.time()
            model.train()
            loss = float("nan")
            for step in range(1, steps + 1):
                idx = torch.tensor(rng.sample(range(len(train)), batch_size))
                opt.zero_grad(set_to_none=True)
                if length_buckets <= 1:
                    out = sft_loss(model, all_ids[idx], all_attn[idx], all_mask[idx])
                    out.backward()  # unclipped: clipping at 1.0 roughly halved the accuracy reached in 300 steps
                    loss = out.item()
                else:
                    loss = _bucketed_step(model, all_ids, all_attn, all_mask, idx, lengths, length_buckets)
                opt.step()
                if verbose and (step % 50 == 0 or step == steps):
                    print(f"[asyncppo] warm start step {step}/{steps} loss {loss:.3f} ({time.time() - t0:.1f}s)",
                          flush=True)
            train_s = time.time() - t0
            report = {"steps": steps, "final_loss": loss, "train_s": round(train_s, 2)}
            if held_out:
                report["greedy_acc"] = answer_accuracy(model, tokenizer, held_out, temperature=0.0,
                                                       max_new_tokens=max_new_tokens)
                report["sampled_acc"] = answer_accuracy(model, tokenizer, held_out, temperature=1.0, seed=seed,
                                                        max_new_tokens=max_new_tokens)
                if verbose:
                    print(
                        f"[asyncppo] warm start: held-out greedy acc {report['greedy_acc']:.3f}, "
                        f"sampled (T=1) acc {report['sampled_acc']:.3f}",
                        flush=True,
                    )
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(model_dir, safe_serialization=True)
    return report
