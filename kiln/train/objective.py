"""The pretraining objective: what the training loop minimises. Later stages pass their own
`loss_fn(model, batch) -> (mean loss over the batch's counted tokens, number of counted tokens)` in
the same shape."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kiln.data.mlm import IGNORE_INDEX, MaskedLMSource, Masker
from kiln.data.tokenizer import Tokenizer
from kiln.model.moe import moe_aux_loss
from kiln.train.chunked_ce import linear_cross_entropy

LossFn = Callable[[torch.nn.Module, tuple], tuple[torch.Tensor, int]]


def next_token_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
    """batch: (inputs, targets) or, under context parallelism, (inputs, targets, position_ids)."""
    inputs, targets, *positions = batch
    logits = model(inputs, *positions)
    # In float32: a softmax over a large vocabulary in bf16 loses the small probabilities.
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return _with_moe_aux(model, loss), targets.numel()


def chunked_next_token_loss(chunk_tokens: int) -> LossFn:
    """next_token_loss with the output head and cross-entropy computed `chunk_tokens` tokens at a
    time (train.loss_chunk_tokens, kiln.train.chunked_ce), so the [tokens, vocab] logits are never
    held whole. The model must be a decoder Transformer called directly (no wrapper)."""

    def loss_fn(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
        inputs, targets, *positions = batch
        hidden = model(inputs, *positions, hidden_only=True)
        loss = linear_cross_entropy(hidden, model.head_weight(), targets, chunk_tokens)
        return _with_moe_aux(model, loss), targets.numel()

    return loss_fn


def _with_moe_aux(model, loss: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and isinstance(model, torch.nn.Module):
        # MoE load-balancing and router z-losses train with the LM loss (and so show in the logged
        # training loss); validation reports the LM loss alone.
        aux = moe_aux_loss(model)
        if aux is not None:
            loss = loss + aux
    return loss


# ---- encoder objectives (kiln/model/bert.py) --------------------------------------------------


def masked_lm_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
    """batch: (masked inputs, labels) from kiln.data.mlm.MaskedLMSource; the mean cross entropy over
    the selected tokens (labels other than IGNORE_INDEX), and their number."""
    inputs, labels = batch
    logits = model(inputs)
    counted = int((labels != IGNORE_INDEX).sum())
    # Summed and divided by the count, so a batch where no token was selected gives 0, not NaN.
    total = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    return total / max(counted, 1), counted


def classification_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
    """batch: (tokens, attention_mask, labels) rows of kiln.data.mlm.classification_rows; the mean
    cross entropy over the sequences, and their number."""
    tokens, attention_mask, labels = batch
    logits = model(tokens, attention_mask)
    return F.cross_entropy(logits.float(), labels), labels.numel()


def masked_lm_objective(tokenizer: Tokenizer, seed: int) -> dict:
    """The Trainer arguments that pretrain a BERT on a pack: the masked-LM loss, and the pack's
    sources masked with the tokenizer's <|mask|> (refused when it has none) under `seed`."""
    masker = Masker.for_tokenizer(tokenizer, seed)
    return {"loss_fn": masked_lm_loss, "wrap_data": lambda source: MaskedLMSource(source, masker)}


# ---- encoder-decoder objectives (kiln/model/t5.py) -----------------------------------------


def seq2seq_loss(model: torch.nn.Module, batch: tuple) -> tuple[torch.Tensor, int]:
    """An encoder-decoder's loss: batch (encoder input [B, S], decoder input [B, T], labels [B, T]),
    as kiln.data.span.SpanCorruptionSource gives; labels of -100 are not counted."""
    inputs, decoder_inputs, labels = batch
    logits = model(inputs, decoder_inputs)
    counted = labels != -100
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, int(counted.sum())
