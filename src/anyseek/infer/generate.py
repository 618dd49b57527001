"""Text generation, the simple way: re-run the whole prefix each step (no KV cache yet).

Good for the short sample at the end of a training run; a latent-KV-cache decoder belongs to the inference work.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int = 40,
    temperature: float = 0.8,
    top_k: int = 40,
    eos_token_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """Sample up to `max_new_tokens` after `prompt_ids`; stops at `eos_token_id`. Returns only the new tokens.

    Uses its own generator so sampling never disturbs the training RNG streams.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt_ids)
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            x = torch.tensor([ids], dtype=torch.long, device=device)  # (1, S)
            logits = model(x).logits[0, -1].float().cpu()  # (V,)
            next_id = _sample(logits, temperature, top_k, gen)
            if eos_token_id is not None and next_id == eos_token_id:
                break
            ids.append(next_id)
            new.append(next_id)
    finally:
        model.train(was_training)
    return new


def _sample(logits: torch.Tensor, temperature: float, top_k: int, gen: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
