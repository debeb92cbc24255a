"""Training rows: conversations rendered with the chat template into fixed-length tensors, the loss
on assistant tokens only (every other target is IGNORE), and the trimming of trailing padding.

An SFT row is (inputs, targets, position_ids, document_ids), [seq_len] each; several conversations
share a row when packed, kept apart by their document ids. SFT, distillation and the SFT-loss
validation of GRPO and PPO use these rows; DPO's pairs and RM's pairs are built in their stages.
"""

from __future__ import annotations

import torch

from kiln.data.chat import render_conversation
from kiln.post.data import pack_sft

IGNORE = -100


def pad(ids: list[int], length: int, value: int) -> list[int]:
    return (ids + [value] * length)[:length]


def trimmed(targets: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cut [B, T] tensors after the last position that has a target in any row. Attention is causal,
    so the trailing padding changes nothing that is scored; rows padded to seq_len would otherwise
    run the model on ~3x the positions (bench/post.py)."""
    counted = (targets != IGNORE).any(0).nonzero()
    n = int(counted[-1]) + 1 if len(counted) else 1
    return tuple(t[:, :n] for t in (targets, *tensors))


def sft_rows(tokenizer, conversations: list[list[dict]], seq_len: int, packing: bool) -> tuple[list, dict]:
    """SFT rows of `conversations` (best-fit packed, or one per row) and counts of what went in."""
    tokenized = [render_conversation(tokenizer, messages) for messages in conversations]
    pad_id = tokenizer.token_id("<|pad|>")
    if packing:
        rows = [
            (
                torch.as_tensor(r.inputs),
                torch.as_tensor(r.targets),
                torch.as_tensor(r.position_ids),
                torch.as_tensor(r.document_ids),
            )
            for r in pack_sft(tokenized, seq_len, pad_id=pad_id)
        ]
    else:
        rows = [_single_row(ids, mask, seq_len, pad_id) for ids, mask in tokenized]
    return rows, {
        "conversations": len(tokenized),
        "rows": len(rows),
        "assistant_tokens": sum(sum(m) for _, m in tokenized),
    }


def _single_row(ids: list[int], mask: list[int], seq_len: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    targets = [t if m else IGNORE for t, m in zip(ids[1:], mask[1:])]
    n = len(ids) - 1
    return (
        torch.tensor(pad(ids[:-1], seq_len, pad_id)),
        torch.tensor(pad(targets, seq_len, IGNORE)),
        torch.tensor(pad(list(range(n)), seq_len, 0)),
        torch.tensor([0] * n + [1] * (seq_len - n))[:seq_len],
    )


def stacked(rows: list[tuple], size: int) -> list[tuple[torch.Tensor, ...]]:
    """Rows stacked into batches of `size` (the last one smaller), in order."""
    return [tuple(torch.stack(p) for p in zip(*rows[i : i + size])) for i in range(0, len(rows), size)]
