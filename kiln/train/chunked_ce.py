"""The output head and the cross-entropy in chunks of tokens (train.loss_chunk_tokens).

The plain loss writes [tokens, vocab] logits in the compute dtype, a float32 copy for the softmax,
and as many gradients of each in backward; at vocabularies of 32k-256k that is the step's largest
activation. Here each chunk's logits live only inside the forward: the loss and, when a gradient
is wanted, the chunk's gradients with respect to the hidden states and the head weight are
computed there and then (the loss is a scalar, so backward only scales them by its incoming
gradient). That keeps the three matmuls of the plain head (no recomputation) while the peak holds
one [chunk, vocab] float32 block, plus the weight's gradient, which the parameter gets anyway."""

from __future__ import annotations

import torch

IGNORE_INDEX = -100  # F.cross_entropy's default: targets of this value are not counted


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, ignore_index, compute_dtype, want_grads):
        counted = targets != ignore_index
        # F.cross_entropy's mean: over the counted targets (NaN when none is counted, as there).
        count = counted.sum().to(torch.float32)
        w = weight.to(compute_dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grads else None
        for start in range(0, hidden.shape[0], chunk_tokens):
            h = hidden[start : start + chunk_tokens].to(compute_dtype)
            keep = counted[start : start + chunk_tokens]
            target = targets[start : start + chunk_tokens].masked_fill(~keep, 0)
            logits = torch.mm(h, w.t()).float()  # float32 softmax, as the plain loss upcasts
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, target[:, None]).squeeze(1)
            total = total + ((lse - picked) * keep).sum()
            if not want_grads:
                continue
            # d(mean CE)/d(logits) = (softmax - onehot(target)) / count on counted rows, 0 elsewhere;
            # built in place in the logits' buffer so the chunk holds one [chunk, vocab] block.
            probs = logits.sub_(lse[:, None]).exp_()
            probs.scatter_add_(1, target[:, None], -torch.ones_like(lse)[:, None])
            probs.mul_((keep.to(torch.float32) / count)[:, None])
            g = probs.to(compute_dtype)
            grad_hidden[start : start + chunk_tokens] = torch.mm(g, w).to(hidden.dtype)
            grad_weight += torch.mm(g.t(), h).float()
        if want_grads:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_loss.to(grad_hidden.dtype),
            grad_weight * grad_loss.to(grad_weight.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean cross-entropy of `F.linear(hidden, weight)` against targets (those equal to
    ignore_index not counted), `chunk_tokens` rows of logits at a time. hidden [..., dim], weight
    [vocab, dim], targets [...]. Under autocast the matmuls run in its dtype and the softmax in
    float32, as `F.cross_entropy(F.linear(hidden, weight).float(), targets)` does there."""
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    device_type = hidden.device.type
    autocasting = torch.is_autocast_enabled(device_type)
    compute_dtype = torch.get_autocast_dtype(device_type) if autocasting else weight.dtype
    want_grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    # The function picks its own dtypes; autocast would otherwise recast inside it.
    with torch.autocast(device_type, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(
            hidden.flatten(0, -2),
            weight,
            targets.flatten(),
            chunk_tokens,
            ignore_index,
            compute_dtype,
            want_grads,
        )
