"""Sampling text from a model: temperature, top-k and nucleus (top-p) filtering.

Each new token reruns the model over the whole (cropped) context; there is no KV cache here, which
keeps this the plain reference that a cached engine can be checked against.
"""

from __future__ import annotations

import torch

from kiln.infer.config import SampleConfig


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the smallest set whose probability
    reaches top_p (Holtzman et al. 2019). logits: [..., vocab]; returns a new tensor."""
    logits = logits.clone()
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits[logits < kth_largest] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token never is.
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= top_p
        drop_sorted[..., 0] = False  # a top_p below float32's range rounds to 0 and would drop every token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits[drop] = float("-inf")
    return logits


@torch.inference_mode()
def generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    stop_ids=(),
) -> list[int]:
    """New token ids after prompt_ids (the stop token that ended generation is not included).

    temperature 0 means greedy. The context is cropped to the model's max_seq_len, keeping the most
    recent tokens. `generator` makes sampling reproducible; it must live on the model's device.
    """
    if not prompt_ids:
        raise ValueError("generate: prompt_ids is empty; give at least one token (e.g. the eot id)")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    max_len = model.cfg.max_seq_len
    stop = set(stop_ids)
    context = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new_tokens: list[int] = []
    try:
        for _ in range(max_new_tokens):
            logits = model(context[:, -max_len:])[0, -1].float()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token in stop:
                break
            new_tokens.append(token)
            context = torch.cat([context, context.new_tensor([[token]])], dim=1)
    finally:
        model.train(was_training)
    return new_tokens


def sample_texts(model, tokenizer, cfg: SampleConfig) -> list[str]:
    """cfg.num_samples completions of cfg.prompt (the continuation text only, without the prompt)."""
    cfg.validate()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device)
    generator.manual_seed(cfg.seed)
    # Pretraining shards end every document with <|endoftext|>, so a document normally starts right
    # after one: leading with it makes the prompt read as a document's beginning, not its middle.
    prompt_tokens = tokenizer.encode(cfg.prompt)
    prompt_ids = [tokenizer.eot_id] + prompt_tokens
    prompt_text = tokenizer.decode(prompt_tokens)
    texts = []
    for _ in range(cfg.num_samples):
        new = generate(
            model,
            prompt_ids,
            cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            generator=generator,
            stop_ids=(tokenizer.eot_id,),
        )
        # Decoding prompt and completion together keeps a character whose bytes straddle the boundary
        # whole; the prompt's own text is then cut off the front.
        full = tokenizer.decode(prompt_tokens + new)
        texts.append(full[len(prompt_text) :] if full.startswith(prompt_text) else tokenizer.decode(new))
    return texts
