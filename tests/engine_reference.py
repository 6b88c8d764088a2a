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
