"""RMSNorm (Zhang & Sennrich 2019) that keeps for backward only what backward needs.

torch's nn.RMSNorm, run under autocast, returns float32 for the float32 residual stream and autograd
keeps that float32 input and float32 output, then the next matmul keeps its own low-precision cast of
the output: 10 bytes per element where 4 do (2h for the norm, 2h for the matmul input). This norm
computes in float32, returns the autocast dtype (so the matmul's cast is a no-op and its saved input is
this output), and keeps the input in that dtype plus one float32 reciprocal RMS per row. Backward
recomputes x / rms from them; the input rounding is the same one the matmuls already see.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the next matmul computes in: autocast's when it is on, else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
    """(the normalised, scaled x in out_dtype, the float32 reciprocal RMS per row); autocast must be off."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    # The order of Hugging Face's LlamaRMSNorm (normalise, round, then scale), so the two agree.
    normed = (x32 * rstd).to(x.dtype)
    return (weight * normed).to(out_dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype):
        with torch.autocast(x.device.type, enabled=False):
            out, rstd = _rms_norm(x, weight, eps, out_dtype)
        ctx.save_for_backward(x.to(out_dtype), rstd, weight)
        ctx.input_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, rstd, weight = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            x_hat = x.float() * rstd
            grad = grad_out.float()
            grad_normed = grad * weight.float()
            # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat)) along the normalised dimension.
            grad_x = rstd * (grad_normed - x_hat * (grad_normed * x_hat).mean(-1, keepdim=True))
            grad_weight = (grad * x_hat).sum(dim=tuple(range(grad.dim() - 1)))
        return grad_x.to(ctx.input_dtype), grad_weight.to(weight.dtype), None, None


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension; parameter `weight` as nn.RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = _compute_dtype(x)
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps, out_dtype)
        # Nothing to record for backward (generation, evaluation): the same arithmetic without the
        # autograd Function's bookkeeping, which cost about 8 of 18 us per call on the CPU, ~5% of a
        # small model's decode step (docs/benchmarks.md).
        if torch.is_autocast_enabled(x.device.type):
            with torch.autocast(x.device.type, enabled=False):
                return _rms_norm(x, self.weight, self.eps, out_dtype)[0]
        return _rms_norm(x, self.weight, self.eps, out_dtype)[0]
