"""Loss functions of the post-training stages: log-probs, reward model, DPO, PPO, GRPO, distillation.

Pure functions on tensors, with no model or trainer state. Every reduction runs in float32 (bf16
inputs are upcast; float64 inputs are kept, which the gradient tests use). A mask is 1/True on
the tokens that count; masked positions contribute nothing to a value or its gradient, even when
the caller left arbitrary numbers (or inf) there.

The formulas follow the anchor projects named in each docstring (TRL, OpenRLHF, torchtune, as read
in shared/research/anchors-post.md); where they disagree, the docstring says which one we follow
and why. docs/post_losses.md collects the formulas, defaults and worked numbers.

Errors for values that come from a recipe raise kiln.errors.ConfigError named after the argument
(which is also the recipe key of the stage); a stage re-raises them with its section prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import ConfigError

IGNORE_INDEX = -100

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
KL_ESTIMATORS = ("k1", "k2", "k3")
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
ADVANTAGE_SCALES = ("group", "batch", "none")
DISTILL_KINDS = ("forward", "reverse")


def _f32(x: torch.Tensor) -> torch.Tensor:
    # Half-precision inputs are upcast; float64 stays float64 so gradients can be checked exactly.
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _bool_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    return torch.broadcast_to(mask.bool(), like.shape)


def _per_token(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-sequence value [B] broadcast over the tokens of `like` [B, T]."""
    x = _f32(x)
    return x.unsqueeze(-1) if x.dim() == like.dim() - 1 else x


# ---------------------------------------------------------------------------------------------
# Masked statistics


def masked_sum(x: torch.Tensor, mask: torch.Tensor | None = None, dim=None) -> torch.Tensor:
    x = _f32(x)
    m = _bool_mask(mask, x)
    # where, not x * mask: a non-finite value at a masked position must not leak in as nan.
    z = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None = None, dim=None) -> torch.Tensor:
    """sum(x * mask) / sum(mask); an empty mask gives 0 rather than nan."""
    m = _bool_mask(mask, _f32(x))
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor | None = None, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked elements, with Bessel's correction when `unbiased` (TRL `masked_var`).

    With a single element the unbiased variance is taken as 0 instead of TRL's nan.
    """
    x = _f32(x)
    m = _bool_mask(mask, x)
    n = m.sum()
    centered = x - masked_mean(x, m)
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    return masked_sum(centered * centered, m) / denom


def whiten(
    x: torch.Tensor, mask: torch.Tensor | None = None, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements; masked positions are set to 0.

    Follows TRL `masked_whiten`: unbiased (Bessel) variance by default (OpenRLHF uses the biased
    one: pass unbiased=False), and shift_mean=False adds the mean back so only the scale changes.
    torchtune's `whiten` has the opposite shift_mean meaning; we do not follow it.
    """
    x = _f32(x)
    m = _bool_mask(mask, x)
    mean, var = masked_mean(x, m), masked_var(x, m, unbiased)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


# ---------------------------------------------------------------------------------------------
# Log-probabilities


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ConfigError("temperature", f"must be > 0, got {temperature}")


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[target] per position: [B, T, V], [B, T] -> [B, T].

    Targets equal to -100 give 0. `logits[:, t]` must already be the prediction of `targets[:, t]`
    (the shift by one is the caller's, as in the pretraining loss). RL stages pass the sampling
    temperature so the log-probs match the distribution that produced the tokens (TRL GRPO divides
    the logits the same way); without it PPO ratios and KL are wrong.
    """
    _check_temperature(temperature)
    valid = targets != IGNORE_INDEX
    logits = _f32(logits)
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, targets.masked_fill(~valid, 0).unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(logits, dim=-1)).masked_fill(~valid, 0.0)


def sequence_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    average: bool = False,
) -> torch.Tensor:
    """Sum over the counted tokens of each row of token_logprobs -> [B] (mean when `average`).

    Counted = targets != -100 and mask. The sum is the sequence log-prob all anchors use for DPO and
    reward margins; the average is TRL's per-token form.
    """
    lp = token_logprobs(logits, targets, temperature)
    m = targets != IGNORE_INDEX
    if mask is not None:
        m = m & mask.bool()
    total = masked_sum(lp, m, dim=-1)
    return total / m.sum(-1).clamp(min=1) if average else total


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: logsumexp(z) - sum softmax(z) * z."""
    _check_temperature(temperature)
    z = _f32(logits) / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)


# ---------------------------------------------------------------------------------------------
# Reward model and DPO


def bradley_terry_loss(
    r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin=None, center_coef: float = 0.0, weights=None
) -> torch.Tensor:
    """mean(-log sigmoid(r_c - r_r - margin)) + center_coef * mean((r_c + r_r)^2).

    As TRL `RewardTrainer` and OpenRLHF `PairWiseLoss`; `margin` is a number or a per-pair tensor
    [B], `center_coef` is TRL's center_rewards_coefficient (0.01 recommended there; off by default).
    `weights` (same shape as the scores, e.g. [B, heads] bootstrap counts) turns the first mean into
    sum(w * term) / sum(w); a batch whose weights are all 0 contributes 0.
    """
    rc, rr = _f32(r_chosen), _f32(r_rejected)
    diff = rc - rr
    if margin is not None:
        diff = diff - (_f32(margin) if torch.is_tensor(margin) else margin)
    if weights is None:
        loss = -F.logsigmoid(diff).mean()
    else:
        w = _f32(weights).expand_as(diff)
        loss = -(F.logsigmoid(diff) * w).sum() / w.sum().clamp_min(1.0)
    if center_coef:
        loss = loss + center_coef * ((rc + rr) ** 2).mean()
    return loss


def pairwise_accuracy(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs with r_chosen strictly above r_rejected (ties count as wrong, as in TRL)."""
    return (r_chosen.detach() > r_rejected.detach()).float().mean()


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    ipo_normalize: bool = True,
):
    """DPO family on sequence log-probs [B]. Returns (mean loss, chosen_rewards [B], rejected_rewards [B]).

    With d_c = policy_chosen - ref_chosen, d_r = policy_rejected - ref_rejected, h = d_c - d_r, eps =
    label_smoothing:
      sigmoid  -(1-eps) log s(beta h) - eps log s(-beta h). eps > 0 is conservative DPO (cDPO) as in
               torchtune, OpenRLHF and TRL <= 0.19; TRL 1.x dropped eps from sigmoid, eps = 0 matches it.
      hinge    relu(1 - beta h)
      ipo      (h' - 1/(2 beta))^2. With ipo_normalize (default) h' = d_c/|y_c| - d_r/|y_r|, each side
               divided by its completion token count (`chosen_lengths`, `rejected_lengths`): TRL's form,
               which its authors confirmed with the IPO authors; it keeps beta meaningful across lengths.
               ipo_normalize=False uses h' = h on the raw sums (OpenRLHF).
      robust   [-(1-eps) log s(beta h) + eps log s(-beta h)] / (1 - 2 eps)   (TRL)
    Rewards are beta * d_c and beta * d_r, detached (the logged "implicit rewards" of every anchor).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ConfigError("loss_type", f"must be one of {', '.join(DPO_LOSS_TYPES)}, got {loss_type!r}")
    if not beta > 0:
        raise ConfigError("beta", f"must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigError("label_smoothing", f"must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing and loss_type not in ("sigmoid", "robust"):
        raise ConfigError("label_smoothing", f"applies to sigmoid and robust only, not {loss_type!r}")
    d_c = _f32(policy_chosen) - _f32(ref_chosen)
    d_r = _f32(policy_rejected) - _f32(ref_rejected)
    h = d_c - d_r
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        if ipo_normalize:
            if chosen_lengths is None or rejected_lengths is None:
                raise ValueError(
                    "ipo with ipo_normalize=True needs chosen_lengths and rejected_lengths (completion token counts)"
                )
            h = d_c / _f32(chosen_lengths).clamp(min=1) - d_r / _f32(rejected_lengths).clamp(min=1)
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    return losses.mean(), (beta * d_c).detach(), (beta * d_r).detach()


# ---------------------------------------------------------------------------------------------
# KL, GAE and PPO


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str = "k1",
    mask: torch.Tensor | None = None,
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from the sampled tokens' log-probs; 0 where masked.

    With r = ref_logp - logp (Schulman's estimators, the convention of TRL and OpenRLHF):
      k1 = -r                 unbiased, can be negative per token
      k2 = r^2 / 2            biased, >= 0
      k3 = exp(r) - r - 1     unbiased, >= 0 (GRPO's KL term)
    `clamp` bounds the estimate to [-clamp, clamp] (OpenRLHF uses 10; TRL and the default do not).
    """
    if kind not in KL_ESTIMATORS:
        raise ConfigError("kind", f"must be one of {', '.join(KL_ESTIMATORS)}, got {kind!r}")
    logp = _f32(logp)
    m = _bool_mask(mask, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Zero r at masked positions before exp so their gradient is 0, not 0 * inf.
    r = torch.where(m, _f32(ref_logp) - logp, zero)
    if kind == "k1":
        kl = -r
    elif kind == "k2":
        kl = 0.5 * r * r
    else:
        kl = torch.expm1(r) - r
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    return torch.where(m, kl, zero)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [B, T]. Returns (advantages, returns), detached, 0 where masked.

    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns = A + V, with
    V and A past the last counted token taken as 0 (TRL, torchtune; defaults gamma 1, lam 0.95 as
    theirs, OpenRLHF uses lam 1). Masked positions are skipped rather than treated as steps, so
    t+1 means the next counted token: for right-padded responses this is exactly TRL's recursion,
    and a mask with holes (e.g. tool output inside a response) does not break the chain. Rewards
    on masked positions are ignored, so the stage puts the sequence score on the last counted token.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ConfigError("gamma", f"must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ConfigError("lam", f"must be in [0, 1], got {lam}")
    rewards, values = _f32(rewards.detach()), _f32(values.detach())
    m = mask.bool()
    next_v = torch.zeros_like(values[:, 0])
    next_a = torch.zeros_like(values[:, 0])
    adv = [None] * rewards.shape[1]
    for t in range(rewards.shape[1] - 1, -1, -1):
        a = rewards[:, t] + gamma * next_v - values[:, t] + gamma * lam * next_a
        adv[t] = torch.where(m[:, t], a, torch.zeros_like(a))
        next_v = torch.where(m[:, t], values[:, t], next_v)
        next_a = torch.where(m[:, t], a, next_a)
    advantages = torch.stack(adv, dim=1)
    returns = torch.where(m, advantages + values, torch.zeros_like(values))
    return advantages, returns


def ppo_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
    clip_high: float | None = None,
):
    """Clipped surrogate. Returns (loss, clip_fraction, approx_kl); the last two are detached.

    ratio = exp(logp - old_logp); loss = masked_mean(max(-A ratio, -A clip(ratio, 1-clip, 1+clip_high)))
    (TRL, torchtune, OpenRLHF). clip_high defaults to clip (asymmetric clipping as in DAPO when set).
    clip_fraction = share of counted tokens where the clipped term is the larger one (its gradient
    is zero there); approx_kl = 0.5 masked_mean((logp - old_logp)^2) (TRL's logged approxkl).
    advantages are [B, T] or [B] (broadcast over tokens) and are treated as constants.
    """
    clip_high = clip if clip_high is None else clip_high
    if not clip > 0 or not clip_high > 0:
        raise ConfigError("clip", f"must be > 0, got {clip} / {clip_high}")
    logp = _f32(logp)
    m = _bool_mask(mask, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(m, logp - _f32(old_logp.detach()), zero)
    ratio = torch.exp(log_ratio)
    adv = _per_token(advantages.detach(), logp)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip, 1 + clip_high)
    loss = masked_mean(torch.maximum(unclipped, clipped), m)
    clip_fraction = masked_mean((clipped > unclipped).float(), m).detach()
    approx_kl = 0.5 * masked_mean(log_ratio.detach() ** 2, m)
    return loss, clip_fraction, approx_kl


def ppo_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float | None = 0.2
) -> torch.Tensor:
    """0.5 masked_mean(max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)); clip=None: unclipped.

    The default c = 0.2 is TRL's cliprange_value and torchtune's value_clip; OpenRLHF uses 0.5.
    """
    values = _f32(values)
    returns, old_values = _f32(returns.detach()), _f32(old_values.detach())
    err = (values - returns) ** 2
    if clip is not None:
        if not clip > 0:
            raise ConfigError("clip", f"must be > 0, got {clip}")
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * masked_mean(err, mask)


# ---------------------------------------------------------------------------------------------
# GRPO


def _nanstd(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    # Bessel-corrected, ignoring nan (a reward function that failed); one value gives std 0.
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    std = var.sqrt()
    return std if keepdim or dim is None else std.squeeze(dim)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages for rewards [G * n] laid out group by group (n = group_size consecutive
    samples of one prompt) -> [G * n].

    A = (r - mean_group) / (std + eps) with the unbiased (Bessel) std, as TRL (`nanstd`) and
    OpenRLHF (`torch.std`). eps = 1e-4 follows TRL (OpenRLHF uses 1e-9): a group whose rewards are
    all equal gets A = 0 either way, and 1e-4 bounds A when the std is tiny but not zero.
    scale: "group" (per-group std, TRL default), "batch" (one std over all rewards, TRL
    scale_rewards="batch"), "none" (A = r - mean_group, Dr. GRPO). nan rewards give A = 0.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ConfigError("scale", f"must be one of {', '.join(ADVANTAGE_SCALES)}, got {scale!r}")
    if group_size < 2:
        raise ConfigError("group_size", f"must be >= 2 (advantages compare samples of one prompt), got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got shape {tuple(rewards.shape)}"
        )
    r = _f32(rewards.detach()).view(-1, group_size)
    adv = r - torch.nanmean(r, dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (_nanstd(r, dim=1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (_nanstd(r) + eps)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 0.2,
    eps_high: float | None = None,
    beta: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    loss_type: str = "grpo",
    max_len: int | None = None,
    num_tokens=None,
):
    """Clipped GRPO objective on completion tokens [B, T] with one advantage per sequence [B].

    Per token (TRL `GRPOTrainer._compute_loss`): ratio = exp(logp - old_logp) (old_logp=None means
    on-policy: logp detached, ratio 1, gradient still the policy gradient);
      l_t = -min(ratio A, clip(ratio, 1-eps, 1+eps_high) A) + beta k3_t,
    with the KL in the loss (not the reward), k3 = exp(ref - logp) - (ref - logp) - 1.
    Aggregation over the counted tokens:
      "grpo"    mean over sequences of (sum_t l_t / |y_i|): the original GRPO, biased by length.
      "dr_grpo" sum l_t / (B * max_len); max_len is the generation limit (default T), a constant so
                every token weighs the same whatever the lengths (Dr. GRPO).
      "dapo"    sum l_t / number of counted tokens (DAPO; TRL's default). Pass `num_tokens` (the
                count over the whole accumulation window) so micro-batches weigh tokens equally.
    Returns (loss, stats) with detached stats: clip_low / clip_high / clip_region fractions
    (as TRL logs them), ratio (masked mean), and kl (masked mean k3) when ref_logp is given.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ConfigError("loss_type", f"must be one of {', '.join(GRPO_LOSS_TYPES)}, got {loss_type!r}")
    eps_high = eps if eps_high is None else eps_high
    if not 0 < eps < 1 or not eps_high > 0:
        raise ConfigError("eps", f"must be in (0, 1) (eps_high > 0), got {eps} / {eps_high}")
    if beta < 0:
        raise ConfigError("beta", f"must be >= 0, got {beta}")
    if beta > 0 and ref_logp is None:
        raise ConfigError("beta", "beta > 0 needs the reference model's log-probs (ref_logp)")
    logp = _f32(logp)
    m = _bool_mask(mask, logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    old = logp.detach() if old_logp is None else _f32(old_logp.detach())
    ratio = torch.exp(torch.where(m, logp - old, zero))
    adv = _per_token(advantages.detach(), logp)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps_high) * adv)
    stats = {}
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, "k3", m)
        if beta:
            per_token = per_token + beta * kl
        stats["kl"] = masked_mean(kl.detach(), m)
    if loss_type == "grpo":
        loss = (masked_sum(per_token, m, dim=-1) / m.sum(-1).clamp(min=1)).mean()
    elif loss_type == "dr_grpo":
        loss = masked_sum(per_token, m) / (logp.shape[0] * (max_len or logp.shape[-1]))
    else:
        count = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=logp.dtype, device=logp.device)
        loss = masked_sum(per_token, m) / count.clamp(min=1)
    r = ratio.detach()
    low = (r < 1 - eps) & (adv < 0)
    high = (r > 1 + eps_high) & (adv > 0)
    stats.update(
        clip_low=masked_mean(low.float(), m),
        clip_high=masked_mean(high.float(), m),
        clip_region=masked_mean((low | high).float(), m),
        ratio=masked_mean(r, m),
    )
    return loss, stats


# ---------------------------------------------------------------------------------------------
# Distillation


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor | None = None,
    kind: str = "forward",
    temperature: float = 1.0,
    alpha: float = 0.5,
) -> torch.Tensor:
    """alpha * T^2 * KL + (1 - alpha) * CE, each a mean over the counted tokens.

    p_s = softmax(student / T), p_t = softmax(teacher / T) over the vocabulary, per position.
      forward: KL(p_t || p_s) = sum p_t (log p_t - log p_s)  (mean-seeking; TRL GKD beta=0)
      reverse: KL(p_s || p_t) = sum p_s (log p_s - log p_t)  (mode-seeking; TRL GKD beta=1)
    CE is the student's cross entropy on `targets` at temperature 1. The T^2 factor is Hinton et
    al.'s: soft-target gradients shrink as 1/T^2, so scaling keeps the KL/CE balance set by alpha
    when T changes (TRL's GKD has no CE term and no T^2; at T = 1 the two agree). Counted tokens:
    targets != -100 and mask. The teacher gets no gradient.
    """
    if kind not in DISTILL_KINDS:
        raise ConfigError("kind", f"must be one of {', '.join(DISTILL_KINDS)}, got {kind!r}")
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError("alpha", f"must be in [0, 1], got {alpha}")
    _check_temperature(temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ (same tokenizer and vocabulary needed)"
        )
    valid = targets != IGNORE_INDEX
    if mask is not None:
        valid = valid & mask.bool()
    # Only counted positions go through the [N, V] softmaxes, which bounds memory on padded batches.
    s = _f32(student_logits[valid])
    t = _f32(teacher_logits.detach()[valid])
    n = max(s.shape[0], 1)
    log_s = F.log_softmax(s / temperature, dim=-1)
    log_t = F.log_softmax(t / temperature, dim=-1)
    if kind == "forward":
        kl = (log_t.exp() * (log_t - log_s)).sum() / n
    else:
        kl = (log_s.exp() * (log_s - log_t)).sum() / n
    ce = F.cross_entropy(s, targets[valid], reduction="sum") / n
    return alpha * temperature**2 * kl + (1 - alpha) * ce
