"""The independent reference the engine tests compare against: a plain transformers forward pass (no
``generate``, no engine code), and the addition prompts they share."""

from __future__ import annotations

import torch


@torch.no_grad()
def ref_logprobs(model, prompt, response, temperature, top_k=-1, top_p=1.0):
    """Log-probs of ``response`` after ``prompt`` under ``log_softmax(logits / T)``, top-k / top-p filtered."""
    ids = torch.tensor([list(prompt) + list(response)])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:  # keep the most probable tokens until their mass reaches top_p
        probs, order = torch.softmax(logits, -1).sort(dim=-1, descending=True)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(response, dtype=torch.long)[:, None]).squeeze(1).numpy()


def hf_greedy(model, tokenizer, prompts, new_tokens) -> list[list[int]]:
    """Greedy continuation by plain argmax over full forwards, ending after EOS as an engine does."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = tokenizer(p, add_special_tokens=False).input_ids
            new: list[int] = []
            while len(new) < new_tokens and (not new or new[-1] != tokenizer.eos_token_id):
                new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
            outs.append(new)
    return outs


def perturb_changing_greedy(model, tokenizer, prompts, new_tokens, scale: float = 0.3, seed: int = 1):
    """Add seeded noise to every weight in place; returns (greedy before, greedy after), asserting they differ
    (a push test whose new weights answer like the old ones proves nothing)."""
    old = hf_greedy(model, tokenizer, prompts, new_tokens)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    new = hf_greedy(model, tokenizer, prompts, new_tokens)
    assert new != old, "the perturbation must change greedy output, or the test proves nothing"
    return old, new
