"""train.loss_chunk_tokens: the chunked output head + cross-entropy (kiln.train.chunked_ce) gives the
plain loss's value and gradients, without holding [tokens, vocab] logits."""

import json

import pytest
import torch
import torch.nn.functional as F
from kiln_testing.train import tiny_train_config
from torch.distributed._tools.mem_tracker import MemTracker

from kiln.errors import ConfigError
from kiln.model import ModelConfig, build_model
from kiln.train.chunked_ce import linear_cross_entropy
from kiln.train.config import TrainConfig
from kiln.train.objective import chunked_next_token_loss, next_token_loss
from kiln.train.precision import autocast
from kiln.train.trainer import Trainer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max() / b.detach().abs().max())


def _inputs(tokens=300, dim=48, vocab=1000):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) * 0.2).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[::7] = -100  # masked labels: not counted in the mean, no gradient
    return hidden, weight, targets


# bf16: both sides round the logits and gradients to bf16 (2^-8 relative), at different points:
# the plain head rounds the weight gradient once over all tokens, the chunked one once per chunk.
@pytest.mark.parametrize("precision, loss_tol, grad_tol", [("fp32", 1e-6, 1e-6), ("bf16", 1e-6, 1e-2)])
def test_matches_plain_loss_and_gradients_with_masked_labels(precision, loss_tol, grad_tol):
    hidden, weight, targets = _inputs()
    with autocast(precision, "cpu"):
        plain = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    plain_grads = torch.autograd.grad(plain, (hidden, weight))
    with autocast(precision, "cpu"):
        chunked = linear_cross_entropy(hidden, weight, targets, chunk_tokens=128)  # 300 = 128 + 128 + 44
    chunked_grads = torch.autograd.grad(chunked * 3.0, (hidden, weight))  # an incoming gradient other than 1
    assert _rel(chunked, plain) <= loss_tol
    for got, want in zip(chunked_grads, plain_grads):
        assert _rel(got, 3.0 * want) <= grad_tol
    assert chunked_grads[0][::7].abs().max() == 0  # masked rows get no gradient
    with torch.no_grad(), autocast(precision, "cpu"):  # evaluation: the loss alone
        assert _rel(linear_cross_entropy(hidden, weight, targets, 64), plain) <= loss_tol


@pytest.mark.parametrize("tie", [False, True])
def test_next_token_loss_matches_through_the_model_with_moe(tie):
    cfg = ModelConfig(
        vocab_size=97, dim=32, n_layers=2, n_heads=4, max_seq_len=24, tie_embeddings=tie, moe_every=2, n_experts=4
    )
    model = build_model(cfg)
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, 97, (3, 24), generator=gen), torch.randint(0, 97, (3, 24), generator=gen))
    grads = []
    for loss_fn in (next_token_loss, chunked_next_token_loss(20)):
        model.zero_grad()
        loss, count = loss_fn(model, batch)
        loss.backward()
        grads.append((loss.detach(), count, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, n_plain, g_plain), (chunked, n_chunked, g_chunked) = grads
    assert n_plain == n_chunked == 72
    assert _rel(chunked, plain) <= 1e-6  # the MoE aux loss is in both
    for name, grad in g_plain.items():
        assert _rel(g_chunked[name], grad) <= 1e-5, name


def _peak_bytes(fn) -> int:
    tracker = MemTracker()
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def test_peak_memory_holds_one_chunk_of_logits():
    hidden, weight, targets = _inputs(tokens=1024, dim=32, vocab=4096)
    logits_bytes = 1024 * 4096 * 4

    def plain():
        F.cross_entropy(F.linear(hidden, weight).float(), targets).backward()

    def chunked():
        linear_cross_entropy(hidden, weight, targets, chunk_tokens=128).backward()

    plain_peak, chunked_peak = _peak_bytes(plain), _peak_bytes(chunked)
    # The plain head holds the float32 logits and their gradient at once; the chunked one an eighth
    # of the logits (and a softmax temporary of that size) plus the weight gradient (4096 x 32 floats).
    assert plain_peak >= 2 * logits_bytes
    assert chunked_peak <= logits_bytes / 2


def test_config_refusals(tiny_pack_factory, tmp_path):
    with pytest.raises(ConfigError, match="loss_chunk_tokens"):
        TrainConfig(loss_chunk_tokens=-1).validate()
    pack = tiny_pack_factory(tmp_path / "pack")
    model = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens.*own loss"):
        Trainer(model, tiny_train_config(loss_chunk_tokens=32), pack, tmp_path / "run", loss_fn=next_token_loss)


def test_trainer_with_chunked_head_logs_the_plain_losses(tiny_pack_factory, tmp_path):
    pack = tiny_pack_factory(tmp_path / "pack")
    model = ModelConfig(dim=32, n_layers=2, n_heads=4, max_seq_len=32)
    losses = {}
    for chunk in (0, 24):  # 64 tokens per micro-batch: chunks of 24, 24, 16
        out = tmp_path / f"chunk{chunk}"
        trainer = Trainer(model, tiny_train_config(max_steps=4, eval_every=2, loss_chunk_tokens=chunk), pack, out)
        heads = set()  # whether each model call asked for hidden states (the chunked head) or logits
        trainer.model.register_forward_pre_hook(
            lambda _m, _args, kwargs: heads.add(kwargs.get("hidden_only", False)), with_kwargs=True
        )
        trainer.fit()
        assert heads == {chunk > 0}
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        losses[chunk] = [r.get("loss", r.get("val_loss")) for r in rows if r["kind"] in ("train", "val")]
    assert len(losses[0]) >= 5
    assert losses[24] == pytest.approx(losses[0], rel=1e-5)
