"""The pretraining objective: what the training loop minimises. Later stages pass their own
`loss_fn(model, batch) -> (mean loss over the batch's counted tokens, number of counted tokens)` in
the same shape."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.model.moe import moe_aux_loss

LossFn = Callable[[torch.nn.Module, tuple], tuple[torch.Tensor, int]]


def next_token_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
    """batch: (inputs, targets) or, under context parallelism, (inputs, targets, position_ids)."""
    inputs, targets, *positions = batch
    logits = model(inputs, *positions)
    # In float32: a softmax over a large vocabulary in bf16 loses the small probabilities.
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    if torch.is_grad_enabled() and isinstance(model, torch.nn.Module):
        # MoE load-balancing and router z-losses train with the LM loss (and so show in the logged
        # training loss); validation reports the LM loss alone.
        aux = moe_aux_loss(model)
        if aux is not None:
            loss = loss + aux
    return loss, targets.numel()


def seq2seq_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
    """An encoder-decoder's loss: batch (encoder input [B, S], decoder input [B, T], labels [B, T]),
    as kiln.data.span.SpanCorruptionSource gives; labels of -100 are not counted."""
    inputs, decoder_inputs, labels = batch
    logits = model(inputs, decoder_inputs)
    counted = labels != -100
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, int(counted.sum())
