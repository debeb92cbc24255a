"""Post-training losses: worked numbers from the anchors note, hand recursions, gradients against a
direct reimplementation, and (when TRL is installed) TRL's own loss code on the same tensors."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.post import losses as L

D = torch.float64  # gradient comparisons run in float64 so tolerances can be tight


def _grad(fn, *xs):
    return torch.autograd.grad(fn(*xs), xs)


def _assert_same_grads(ours, theirs, *shapes, atol=1e-10):
    xs = [torch.randn(s, dtype=D, requires_grad=True) for s in shapes]
    for a, b in zip(_grad(ours, *xs), _grad(theirs, *xs)):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-8)
    return xs


# --------------------------------------------------------------------------------------- log-probs


def test_token_logprobs_matches_naive_and_ignores_minus_100():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, 3] = targets[1, 0] = -100
    lp = L.token_logprobs(logits, targets)
    naive = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    naive[targets == -100] = 0
    torch.testing.assert_close(lp, naive)
    hot = L.token_logprobs(logits, targets, temperature=0.7)
    torch.testing.assert_close(hot[0, 0], (logits[0, 0] / 0.7).log_softmax(-1)[targets[0, 0]])
    assert L.token_logprobs(logits.bfloat16(), targets).dtype == torch.float32


def test_sequence_logprobs_sum_and_average_over_mask():
    logits = torch.randn(2, 4, 7)
    targets = torch.randint(0, 7, (2, 4))
    targets[1, 3] = -100
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    lp = L.token_logprobs(logits, targets)
    torch.testing.assert_close(
        L.sequence_logprobs(logits, targets, mask), torch.stack([lp[0, 1:].sum(), lp[1, :3].sum()])
    )
    torch.testing.assert_close(
        L.sequence_logprobs(logits, targets, mask, average=True), torch.stack([lp[0, 1:].mean(), lp[1, :3].mean()])
    )


def test_token_entropy():
    logits = torch.randn(3, 9)
    p = logits.softmax(-1)
    torch.testing.assert_close(L.token_entropy(logits), -(p * p.log()).sum(-1))


# --------------------------------------------------------------------------------- reward and DPO


def test_bradley_terry_worked_numbers_and_accuracy():
    one, zero = torch.tensor([1.0]), torch.tensor([0.0])
    assert L.bradley_terry_loss(one, zero).item() == pytest.approx(0.3132616875, abs=1e-7)
    assert L.bradley_terry_loss(one, zero, margin=0.5).item() == pytest.approx(0.4740769842, abs=1e-7)
    assert L.bradley_terry_loss(one, zero, margin=torch.tensor([0.5])).item() == pytest.approx(0.4740769842, abs=1e-7)
    acc = L.pairwise_accuracy(torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0.0, 1.0, 2.0, -1.0]))
    assert acc.item() == 0.5  # the tie counts as wrong


def test_bradley_terry_gradient_matches_direct():
    margin = torch.rand(4, dtype=D)
    _assert_same_grads(
        lambda c, r: L.bradley_terry_loss(c, r, margin, center_coef=0.01),
        lambda c, r: (torch.log1p(torch.exp(-(c - r - margin)))).mean() + 0.01 * ((c + r) ** 2).mean(),
        (4,),
        (4,),
    )


def _dpo_worked():
    # policy chosen/rejected, reference chosen/rejected: h = (-10 + 11) - (-12 + 11) = 2
    return [torch.tensor([v]) for v in (-10.0, -12.0, -11.0, -11.0)]


def test_dpo_worked_numbers():
    x = _dpo_worked()
    loss, rc, rr = L.dpo_loss(*x)
    assert loss.item() == pytest.approx(0.5981388694, abs=1e-6)
    assert rc.item() == pytest.approx(0.1) and rr.item() == pytest.approx(-0.1)
    assert L.dpo_loss(*x, label_smoothing=0.1)[0].item() == pytest.approx(0.6181388694, abs=1e-6)
    assert L.dpo_loss(*x, loss_type="hinge")[0].item() == pytest.approx(0.8, abs=1e-6)
    assert L.dpo_loss(*x, loss_type="ipo", ipo_normalize=False)[0].item() == pytest.approx(9.0, abs=1e-5)
    # Normalised IPO (TRL): 4 chosen tokens, 2 rejected: h = 1/4 - (-1/2) = 0.75; (0.75 - 5)^2
    ipo = L.dpo_loss(*x, loss_type="ipo", chosen_lengths=torch.tensor([4]), rejected_lengths=torch.tensor([2]))
    assert ipo[0].item() == pytest.approx(18.0625, abs=1e-4)
    robust = (-0.9 * math.log(1 / (1 + math.exp(-0.2))) + 0.1 * math.log(1 / (1 + math.exp(0.2)))) / 0.8
    assert L.dpo_loss(*x, loss_type="robust", label_smoothing=0.1)[0].item() == pytest.approx(robust, abs=1e-6)


def test_dpo_rejects_bad_settings():
    x = _dpo_worked()
    with pytest.raises(ConfigError, match="loss_type"):
        L.dpo_loss(*x, loss_type="kto")
    with pytest.raises(ConfigError, match="label_smoothing"):
        L.dpo_loss(*x, label_smoothing=0.5)
    with pytest.raises(ConfigError, match="label_smoothing"):
        L.dpo_loss(*x, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ConfigError, match="beta"):
        L.dpo_loss(*x, beta=0.0)
    with pytest.raises(ValueError, match="chosen_lengths"):
        L.dpo_loss(*x, loss_type="ipo")


@pytest.mark.parametrize(
    "loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.1), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.2)]
)
def test_dpo_gradient_matches_direct(loss_type, eps):
    beta, lc, lr = 0.3, torch.tensor([3.0, 5, 1, 2], dtype=D), torch.tensor([2.0, 4, 6, 1], dtype=D)

    def direct(pc, pr, rc, rr):
        h = (pc - rc) - (pr - rr)
        sig = lambda z: torch.log(1 / (1 + torch.exp(-z)))  # noqa: E731
        if loss_type == "sigmoid":
            return (-(1 - eps) * sig(beta * h) - eps * sig(-beta * h)).mean()
        if loss_type == "hinge":
            return torch.clamp(1 - beta * h, min=0).mean()
        if loss_type == "ipo":
            return (((pc - rc) / lc - (pr - rr) / lr - 1 / (2 * beta)) ** 2).mean()
        return ((-(1 - eps) * sig(beta * h) + eps * sig(-beta * h)) / (1 - 2 * eps)).mean()

    ours = lambda *a: L.dpo_loss(  # noqa: E731
        *a,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=eps,  # noqa: E731
        chosen_lengths=lc,
        rejected_lengths=lr,
    )[0]
    xs = _assert_same_grads(ours, direct, (4,), (4,), (4,), (4,))
    if loss_type == "sigmoid" and eps == 0:
        # Closed form: dL/d policy_chosen = -beta * sigmoid(-beta h) / B.
        h = (xs[0] - xs[2]) - (xs[1] - xs[3])
        torch.testing.assert_close(_grad(ours, *xs)[0], -beta * torch.sigmoid(-beta * h.detach()) / 4)


# ------------------------------------------------------------------------------------------- KL


def test_kl_estimators_worked_numbers():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.2])
    assert L.kl_estimate(logp, ref, "k1").item() == pytest.approx(0.2, abs=1e-6)
    assert L.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.02, abs=1e-6)
    assert L.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.0187307531, abs=1e-7)
    with pytest.raises(ConfigError, match="kind"):
        L.kl_estimate(logp, ref, "k4")


def test_kl_estimators_are_unbiased_and_k3_nonnegative():
    g = torch.Generator().manual_seed(1)
    logits_p, logits_q = torch.randn(8, generator=g, dtype=D), torch.randn(8, generator=g, dtype=D)
    logp_all, logq_all = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    exact = (logp_all.exp() * (logp_all - logq_all)).sum().item()
    tokens = torch.multinomial(logp_all.exp(), 200_000, replacement=True, generator=g)
    logp, ref = logp_all[tokens], logq_all[tokens]
    for kind in ("k1", "k3"):
        est = L.kl_estimate(logp, ref, kind)
        # Within 5 standard errors of the exact KL(p || q) on tokens sampled from p.
        assert abs(est.mean().item() - exact) < 5 * est.std().item() / math.sqrt(len(tokens)), kind
    assert (L.kl_estimate(logp, ref, "k3") >= 0).all() and (L.kl_estimate(logp, ref, "k2") >= 0).all()
    assert (L.kl_estimate(logp, ref, "k1") < 0).any()  # k1 is only unbiased on average


def test_kl_masked_positions_are_zero_with_finite_gradient():
    logp = torch.tensor([[-1.0, -1e30]], requires_grad=True)
    ref = torch.tensor([[-1.5, 0.0]])
    mask = torch.tensor([[1, 0]])
    kl = L.kl_estimate(logp, ref, "k3", mask)
    assert kl[0, 1] == 0
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert torch.isfinite(g).all() and g[0, 1] == 0
    assert L.kl_estimate(torch.tensor([0.0]), torch.tensor([50.0]), "k3", clamp=10).item() == 10


# ------------------------------------------------------------------------------------ whitening


def test_whiten_and_masked_stats():
    x = torch.randn(3, 6)
    mask = torch.rand(3, 6) > 0.3
    x_inf = x.masked_fill(~mask, float("inf"))
    w = L.whiten(x_inf, mask)
    assert torch.isfinite(w).all() and (w[~mask] == 0).all()
    sel = w[mask]
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert sel.std().item() == pytest.approx(1.0, abs=1e-5)  # unbiased std (TRL), not population
    kept = L.whiten(x, mask, shift_mean=False)[mask]
    assert kept.mean().item() == pytest.approx(x[mask].mean().item(), abs=1e-5)
    assert L.masked_var(x, mask, unbiased=False).item() == pytest.approx(x[mask].var(unbiased=False).item(), rel=1e-5)
    assert L.masked_mean(x, torch.zeros_like(mask)).item() == 0.0


# ------------------------------------------------------------------------------------------- GAE


def _gae_by_hand(r, v, gamma, lam):
    adv, nxt_v, nxt_a = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * nxt_v - v[t]
        adv[t] = nxt_a = delta + gamma * lam * nxt_a
        nxt_v = v[t]
    return adv


def test_gae_worked_example():
    adv, ret = L.gae(torch.tensor([[0.0, 0, 1]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[0.46575, 0.385, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.96575, 0.985, 1.0]]))


def test_gae_with_padding_and_holes_matches_hand_recursion():
    r, v = torch.randn(2, 6, dtype=D), torch.randn(2, 6, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 0]])
    adv, ret = L.gae(r, v, mask, gamma=0.9, lam=0.8)
    for b in range(2):
        idx = mask[b].nonzero().flatten()
        want = _gae_by_hand(r[b, idx].tolist(), v[b, idx].tolist(), 0.9, 0.8)
        torch.testing.assert_close(adv[b, idx], torch.tensor(want, dtype=D))
        torch.testing.assert_close(ret[b, idx], torch.tensor(want, dtype=D) + v[b, idx])
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    with pytest.raises(ConfigError, match="lam"):
        L.gae(r, v, mask, lam=1.5)


# ------------------------------------------------------------------------------------------- PPO


def test_ppo_policy_clipping_by_hand():
    # ratio 1.5 / A +1: clipped at 1.2 -> -1.2. ratio 0.5 / A -1: clipped at 0.8 -> 0.8.
    # ratio 1.5 / A -1: unclipped 1.5.  ratio 0.5 / A +1: unclipped -0.5.  ratio 1.1 / A 2: inside, -2.2.
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.1]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 2.0]])
    old = torch.full_like(ratio, -2.0)
    logp = (old + ratio.log()).requires_grad_()
    loss, clip_frac, approx_kl = L.ppo_policy_loss(logp, old, adv, torch.ones_like(ratio))
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 0.5 - 2.2) / 5, abs=1e-6)
    assert clip_frac.item() == pytest.approx(2 / 5)
    assert approx_kl.item() == pytest.approx(0.5 * (ratio.log() ** 2).mean().item(), abs=1e-7)
    (g,) = torch.autograd.grad(loss, logp)
    # d(-A ratio)/d logp = -A ratio on the unclipped tokens, 0 on the clipped ones (then / 5).
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.0, 1.5, -0.5, -2.2]]) / 5)
    # The masked token drops out of the mean.
    masked, _, _ = L.ppo_policy_loss(logp, old, adv, torch.tensor([[1, 1, 1, 1, 0]]))
    assert masked.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 0.5) / 4, abs=1e-6)


def test_ppo_policy_gradient_matches_direct():
    adv, old = torch.randn(3, 5, dtype=D), torch.randn(3, 5, dtype=D) - 2
    mask = torch.rand(3, 5) > 0.2

    def direct(logp):
        ratio = torch.exp(logp - old)
        obj = torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.3) * adv)
        return -(obj * mask).sum() / mask.sum()

    def ours(logp):
        return L.ppo_policy_loss(logp, old, adv, mask, clip=0.2, clip_high=0.3)[0]

    # logp spread around old so both clipped and unclipped tokens occur
    logp = (old + 0.4 * torch.randn(3, 5, dtype=D)).requires_grad_()
    torch.testing.assert_close(_grad(ours, logp)[0], _grad(direct, logp)[0])


def test_ppo_value_loss_by_hand_and_gradient():
    values = torch.tensor([[1.0, 0.6, 3.0]], requires_grad=True)
    old, ret = torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([[2.0, 0.0, 5.0]])
    # token 0: clipped V 0.7 -> (0.7-2)^2 = 1.69 > (1-2)^2 = 1; token 1: inside, 0.36; token 2 masked
    loss = L.ppo_value_loss(values, old, ret, torch.tensor([[1, 1, 0]]))
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.36) / 2, abs=1e-6)
    (g,) = torch.autograd.grad(loss, values)
    # clipped token: no gradient; inside: 0.5 * 2 (V - R) / 2
    torch.testing.assert_close(g, torch.tensor([[0.0, 0.3, 0.0]]))
    unclipped = L.ppo_value_loss(values, old, ret, torch.tensor([[1, 1, 0]]), clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.36) / 2, abs=1e-6)

    old_r, ret_r = torch.randn(2, 4, dtype=D), torch.randn(2, 4, dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]])

    def direct(v):
        vc = torch.clamp(v, old_r - 0.2, old_r + 0.2)
        err = torch.max((v - ret_r) ** 2, (vc - ret_r) ** 2)
        return 0.5 * (err * mask).sum() / mask.sum()

    v = (old_r + 0.5 * torch.randn(2, 4, dtype=D)).requires_grad_()
    torch.testing.assert_close(_grad(lambda x: L.ppo_value_loss(x, old_r, ret_r, mask), v)[0], _grad(direct, v)[0])


# ------------------------------------------------------------------------------------------ GRPO


def test_group_advantages_worked_numbers():
    adv = L.group_advantages(torch.tensor([1.0, 0, 0, 1, 3, 3, 3, 3]), group_size=4)
    torch.testing.assert_close(
        adv, torch.tensor([0.8658754298, -0.8658754298, -0.8658754298, 0.8658754298, 0, 0, 0, 0])
    )
    torch.testing.assert_close(
        L.group_advantages(torch.tensor([1.0, 0, 0, 1]), 4, scale="none"), torch.tensor([0.5, -0.5, -0.5, 0.5])
    )
    r = torch.tensor([1.0, 0, 2, 6])
    batch = L.group_advantages(r, 2, scale="batch")
    torch.testing.assert_close(batch, torch.tensor([0.5, -0.5, -2, 2]) / (r.std() + 1e-4))
    # A reward function that failed (nan) gives that sample advantage 0; the others use the rest.
    nan = L.group_advantages(torch.tensor([1.0, float("nan"), 0.0]), 3)
    assert nan[1] == 0 and nan[0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), rel=1e-6)
    with pytest.raises(ConfigError, match="group_size"):
        L.group_advantages(r, 1)
    with pytest.raises(ConfigError, match="scale"):
        L.group_advantages(r, 2, scale="rank")
    with pytest.raises(ValueError, match="multiple"):
        L.group_advantages(r, 3)


def _grpo_batch():
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    logp = -torch.rand(3, 5, generator=g, dtype=D) * 3
    old = logp + 0.3 * torch.randn(3, 5, generator=g, dtype=D)
    ref = logp + 0.5 * torch.randn(3, 5, generator=g, dtype=D)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=D)
    return logp, old, ref, adv, mask


def test_grpo_aggregation_on_policy_by_hand():
    logp, _, _, adv, mask = _grpo_batch()
    lens = mask.sum(-1).to(D)
    # On-policy ratio is 1: each counted token contributes -A of its sequence.
    expect = {"grpo": (-adv).mean(), "dapo": (-adv * lens).sum() / lens.sum(), "dr_grpo": (-adv * lens).sum() / (3 * 8)}
    for loss_type, want in expect.items():
        loss, stats = L.grpo_loss(logp, None, adv, mask, loss_type=loss_type, max_len=8)
        assert loss.item() == pytest.approx(want.item(), abs=1e-12), loss_type
        assert stats["ratio"].item() == pytest.approx(1.0) and stats["clip_region"].item() == 0
    # Gradient with ratio 1 is the policy gradient: -A_i / |y_i| / B per token for "grpo".
    x = logp.clone().requires_grad_()
    (g,) = torch.autograd.grad(L.grpo_loss(x, None, adv, mask)[0], x)
    torch.testing.assert_close(g, (-adv / lens / 3).unsqueeze(-1) * mask)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_gradient_matches_direct(loss_type):
    _, old, ref, adv, mask = _grpo_batch()
    beta, eps, eps_high = 0.04, 0.2, 0.28

    def direct(logp):
        ratio = torch.exp(logp - old)
        obj = torch.min(ratio * adv[:, None], torch.clamp(ratio, 1 - eps, 1 + eps_high) * adv[:, None])
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_tok = (-obj + beta * kl) * mask
        if loss_type == "grpo":
            return (per_tok.sum(-1) / mask.sum(-1)).mean()
        if loss_type == "dr_grpo":
            return per_tok.sum() / (3 * 5)
        return per_tok.sum() / mask.sum()

    def ours(logp):
        return L.grpo_loss(
            logp, old, adv, mask, eps=eps, eps_high=eps_high, beta=beta, ref_logp=ref, loss_type=loss_type
        )[0]

    logp = _grpo_batch()[0].requires_grad_()
    torch.testing.assert_close(ours(logp), direct(logp))
    torch.testing.assert_close(_grad(ours, logp)[0], _grad(direct, logp)[0])


def test_grpo_rejects_bad_settings():
    logp, old, _, adv, mask = _grpo_batch()
    with pytest.raises(ConfigError, match="beta"):
        L.grpo_loss(logp, old, adv, mask, beta=0.1)
    with pytest.raises(ConfigError, match="loss_type"):
        L.grpo_loss(logp, old, adv, mask, loss_type="bnpo2")


# ---------------------------------------------------------------------------------- distillation


def _distill_batch():
    s, t = torch.randn(2, 4, 9, dtype=D), torch.randn(2, 4, 9, dtype=D)
    targets = torch.randint(0, 9, (2, 4))
    targets[0, 0] = targets[1, 3] = -100
    return s, t, targets


@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_distill_kl_matches_kl_div(kind):
    s, t, targets = _distill_batch()
    valid = targets != -100
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    # F.kl_div(input, target) is KL(target || input): forward KL(teacher || student) is kl_div(ls, lt).
    ref = (
        (
            F.kl_div(ls, lt, reduction="none", log_target=True)
            if kind == "forward"
            else F.kl_div(lt, ls, reduction="none", log_target=True)
        )
        .sum(-1)[valid]
        .mean()
    )
    torch.testing.assert_close(L.distill_loss(s, t, targets, kind=kind, alpha=1.0), ref)
    ce = F.cross_entropy(s.flatten(0, 1), targets.flatten(), ignore_index=-100)
    torch.testing.assert_close(L.distill_loss(s, t, targets, kind=kind, alpha=0.0), ce)
    mixed = L.distill_loss(s, t, targets, kind=kind, alpha=0.3)
    torch.testing.assert_close(mixed, 0.3 * ref + 0.7 * ce)
    # T^2 scaling of the soft term at temperature 2
    ls2, lt2 = (s / 2).log_softmax(-1), (t / 2).log_softmax(-1)
    ref2 = (
        (
            F.kl_div(ls2, lt2, reduction="none", log_target=True)
            if kind == "forward"
            else F.kl_div(lt2, ls2, reduction="none", log_target=True)
        )
        .sum(-1)[valid]
        .mean()
    )
    torch.testing.assert_close(L.distill_loss(s, t, targets, kind=kind, temperature=2.0, alpha=1.0), 4 * ref2)


def test_distill_gradient_matches_direct_and_teacher_gets_none():
    s, t, targets = _distill_batch()
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])
    valid = (targets != -100) & mask.bool()

    def direct(student):
        ls, lt = (student / 1.5).log_softmax(-1), (t / 1.5).log_softmax(-1)
        kl = (ls.exp() * (ls - lt)).sum(-1)
        ce = -student.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
        return 0.4 * 2.25 * kl[valid].mean() + 0.6 * ce[valid].mean()

    def ours(student):
        return L.distill_loss(student, t, targets, mask, kind="reverse", temperature=1.5, alpha=0.4)

    x = s.clone().requires_grad_()
    torch.testing.assert_close(_grad(ours, x)[0], _grad(direct, x)[0])
    teacher = t.clone().requires_grad_()
    L.distill_loss(x, teacher, targets).backward()
    assert teacher.grad is None
    with pytest.raises(ConfigError, match="alpha"):
        L.distill_loss(s, t, targets, alpha=1.5)


# ----------------------------------------------------- TRL's own code on the same tensors (optional)


@pytest.fixture(scope="module")
def trl():
    pytest.importorskip("trl")
    import trl as trl_module
    from trl.trainer import utils

    return SimpleNamespace(
        utils=utils,
        GRPOTrainer=trl_module.GRPOTrainer,
        DPOTrainer=trl_module.DPOTrainer,
        gkd=pytest.importorskip("trl.experimental.gkd").GKDTrainer,
    )


def _fake_accelerator():
    return SimpleNamespace(
        gather=lambda x: x,
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction="sum": x,
        num_processes=1,
        device="cpu",
    )


def test_trl_logprobs_std_and_gkd_agree(trl):
    logits, targets = torch.randn(2, 5, 13), torch.randint(0, 13, (2, 5))
    torch.testing.assert_close(
        L.token_logprobs(logits, targets, 0.8), trl.utils.selective_log_softmax(logits, targets, temperature=0.8)
    )
    r = torch.tensor([1.0, 0, 0, 1, 0.3, 0.9, 0.2, 0.4])
    grouped = r.view(-1, 4)
    want = (grouped - grouped.mean(1, keepdim=True)) / (trl.utils.nanstd(grouped, dim=1)[:, None] + 1e-4)
    torch.testing.assert_close(L.group_advantages(r, 4), want.flatten())
    s, t, targets = _distill_batch()
    for beta, kind in ((0.0, "forward"), (1.0, "reverse")):
        theirs = trl.gkd.generalized_jsd_loss(s, t, labels=targets, beta=beta)
        torch.testing.assert_close(L.distill_loss(s, t, targets, kind=kind, alpha=1.0), theirs)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_matches_trl(trl, loss_type):
    _, old, ref, adv, mask = _grpo_batch()
    logp = _grpo_batch()[0].requires_grad_()
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.04,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=5,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        accelerator=_fake_accelerator(),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    inputs = {
        "prompt_ids": torch.zeros(3, 1, dtype=torch.long),
        "prompt_mask": torch.ones(3, 1),
        "completion_ids": torch.zeros(3, 5, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": mask.sum(),
    }
    theirs = trl.GRPOTrainer._compute_loss(fake, None, inputs)
    ours = L.grpo_loss(
        logp, old, adv, mask, eps=0.2, eps_high=0.28, beta=0.04, ref_logp=ref, loss_type=loss_type, max_len=5
    )[0]
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(theirs, logp)[0])


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.1)])
def test_dpo_matches_trl(trl, loss_type, eps):
    # Batch layout of TRL: rows [chosen..., rejected...]; per-token log-probs summed over the completion.
    g = torch.Generator().manual_seed(5)
    completion = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    per_tok = (-torch.rand(4, 5, generator=g, dtype=D) * 2 * completion[:, 1:]).requires_grad_()
    ref = -torch.rand(4, generator=g, dtype=D) * 6
    out = SimpleNamespace(
        log_probs=per_tok,
        entropy=torch.zeros(4, 5),
        mean_logits=torch.zeros(4, 5),
        is_top1=torch.zeros(4, 5, dtype=torch.bool),
    )
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=_fake_accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=0.1,
        label_smoothing=eps,
        use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(4, 6, dtype=torch.long),
        "attention_mask": torch.ones(4, 6),
        "completion_mask": completion,
        "ref_chosen_logps": ref[:2],
        "ref_rejected_logps": ref[2:],
    }
    theirs = trl.DPOTrainer._compute_loss(fake, lambda **k: out, inputs, False)
    seq = per_tok.sum(-1)
    lens = completion.sum(-1)
    ours = L.dpo_loss(
        seq[:2],
        seq[2:],
        ref[:2],
        ref[2:],
        beta=0.1,
        loss_type=loss_type,
        label_smoothing=eps,
        chosen_lengths=lens[:2],
        rejected_lengths=lens[2:],
    )[0]
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(torch.autograd.grad(ours, per_tok)[0], torch.autograd.grad(theirs, per_tok)[0])
