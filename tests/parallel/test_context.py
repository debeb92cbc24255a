"""Context parallelism: layout and ring math in one process, then 2 and 4 gloo ranks against the
single-process run of the same model on the full sequence."""

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.model.transformer import build_model
from kiln.parallel.context import (
    attend_pair,
    pair_grads,
    pair_mask,
    sequence_pieces,
    sequence_positions,
    shard_sequence,
)

SEQ, VOCAB, BATCH = 32, 97, 2
TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Layout and masks (no processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_load_balanced_layout_is_pytorch_head_tail(cp):
    """Same positions per rank as PyTorch's own load balancer, so inputs sharded by Kiln are what
    PyTorch's ring attention (the CUDA backend) assumes."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    theirs = _HeadTailLoadBalancer(8 * cp, cp, "cpu")._generate_indices()[0].view(cp, -1)
    for rank in range(cp):
        assert sequence_positions(8 * cp, rank, cp, True).tolist() == theirs[rank].tolist()
        assert sequence_positions(8 * cp, rank, cp, False).tolist() == list(range(8 * rank, 8 * rank + 8))


@pytest.mark.parametrize("cp,load_balance", [(2, True), (2, False), (3, True), (4, True), (4, False)])
def test_pair_masks_tile_the_causal_mask(cp, load_balance):
    seq = 12 * cp
    full = torch.ones(seq, seq, dtype=torch.bool).tril()
    visible = []
    for rank in range(cp):
        for q_piece in sequence_pieces(seq, rank, cp, load_balance):
            _, qg, qn = q_piece
            for src in range(cp):
                for k_piece in sequence_pieces(seq, src, cp, load_balance):
                    _, kg, kn = k_piece
                    mask = pair_mask(q_piece, k_piece)
                    expected = full[qg : qg + qn, kg : kg + kn]
                    if isinstance(mask, str):
                        assert not expected.any()
                    elif mask is None:
                        assert expected.all()
                    else:
                        assert torch.equal(mask, expected)
        positions = sequence_positions(seq, rank, cp, load_balance)
        visible.append(int(full[positions].sum()))
    assert sum(visible) == int(full.sum())
    if load_balance:
        assert len(set(visible)) == 1, visible  # equal causal work on every rank
    else:
        assert visible == sorted(visible) and visible[0] < visible[-1]


def test_shard_sequence_slices_tokens_targets_and_positions():
    tokens = torch.arange(2 * 17).view(2, 17)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    seen = []
    for rank in range(2):
        x, y, pos = shard_sequence(inputs, targets, rank, 2, True)
        assert x.shape == y.shape == pos.shape == (2, 8)
        assert torch.equal(x, inputs.gather(1, pos)) and torch.equal(y, x + 1)
        seen += pos[0].tolist()
    assert sorted(seen) == list(range(16))
    with pytest.raises(ConfigError, match="parallel.cp.*divisible by 2\\*cp"):
        shard_sequence(inputs[:, :12], targets[:, :12], 0, 4, True)
    with pytest.raises(ConfigError, match="parallel.cp"):
        shard_sequence(inputs[:, :15], None, 0, 2, False)


@pytest.mark.parametrize("load_balance", [True, False])
def test_ring_math_simulated_in_one_process(load_balance):
    """The per-pair online-softmax forward and the per-pair backward, run over every rank's blocks of a
    3-rank layout, give PyTorch's causal SDPA output and its autograd gradients (GQA: 4 q heads, 2 kv)."""
    cp, seq, hd = 3, 24, 8
    q = torch.randn(2, 4, seq, hd, requires_grad=True)
    k = torch.randn(2, 2, seq, hd, requires_grad=True)
    v = torch.randn(2, 2, seq, hd, requires_grad=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad_out = torch.randn_like(ref)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q, k, v), grad_out)
    q5, do5 = q.detach().view(2, 2, 2, seq, hd), grad_out.view(2, 2, 2, seq, hd)
    k, v = k.detach(), v.detach()
    scale = hd**-0.5
    dq, dk, dv = torch.zeros_like(q5), torch.zeros_like(k), torch.zeros_like(v)
    for rank in range(cp):
        queries = sequence_pieces(seq, rank, cp, load_balance)
        # The ring order: own block first, then the previous rank's, and so on.
        blocks = [p for step in range(cp) for p in sequence_pieces(seq, (rank - step) % cp, cp, load_balance)]
        for qp in queries:
            rows = slice(qp[1], qp[1] + qp[2])
            m = torch.full(q5[..., rows, 0].shape, float("-inf"))
            l, acc = torch.zeros_like(m), torch.zeros_like(q5[..., rows, :])
            live = [(kp, pair_mask(qp, kp)) for kp in blocks]
            live = [(slice(kp[1], kp[1] + kp[2]), mask) for kp, mask in live if not isinstance(mask, str)]
            for cols, mask in live:
                attend_pair(q5[..., rows, :], k[..., cols, :], v[..., cols, :], mask, scale, m, l, acc)
            out = acc / l.unsqueeze(-1)
            torch.testing.assert_close(out.view(2, 4, -1, hd), ref[:, :, rows].detach(), rtol=0, atol=TOL)
            lse = m + l.log()
            delta = (do5[..., rows, :] * out).sum(-1)
            for cols, mask in live:
                g_q, g_k, g_v = pair_grads(
                    q5[..., rows, :], k[..., cols, :], v[..., cols, :], do5[..., rows, :], lse, delta, mask, scale
                )
                dq[..., rows, :] += g_q
                dk[..., cols, :] += g_k
                dv[..., cols, :] += g_v
    torch.testing.assert_close(dq.view_as(ref_dq), ref_dq, rtol=0, atol=TOL)
    torch.testing.assert_close(dk, ref_dk, rtol=0, atol=TOL)
    torch.testing.assert_close(dv, ref_dv, rtol=0, atol=TOL)


# ---------------------------------------------------------------------------------------------
# Processes: each rank compares against the single-process run, rank 0 reports
# ---------------------------------------------------------------------------------------------


def _setup(kv_heads):
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=kv_heads, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = build_model(cfg)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return model, tokens[:, :-1], tokens[:, 1:]


def _loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _compare(rank, world, backend, load_balance, kv_heads):
    from kiln.parallel.context import apply_context_parallel

    model, inputs, targets = _setup(kv_heads)
    params = list(model.parameters())
    ref_logits = model(inputs)
    ref_loss = _loss(ref_logits, targets)
    ref_grads = torch.autograd.grad(ref_loss, params)

    cp_model = apply_context_parallel(copy.deepcopy(model), dist.group.WORLD, load_balance, backend)
    x, y, pos = shard_sequence(inputs, targets, rank, world, load_balance)
    logits = cp_model(x, position_ids=pos)
    loss = _loss(logits, y)
    grads = torch.autograd.grad(loss, list(cp_model.parameters()))
    total = loss.detach().clone()
    dist.all_reduce(total)
    grad_diff = 0.0
    for grad, ref in zip(grads, ref_grads):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        grad_diff = max(grad_diff, (grad / world - ref).abs().max().item())
    return {
        "loss_diff": abs(total.item() / world - ref_loss.item()),
        "logit_diff": (logits - ref_logits[:, pos[0]]).abs().max().item(),
        "grad_diff": grad_diff,
        "grad_max": max(g.abs().max().item() for g in ref_grads),
        "attention": repr(cp_model.layers[0].attn.attention),
    }


def _train(rank, world, backend, fsdp=False, steps=3):
    """A few AdamW steps against the single-process run. The cp ranks' gradients are averaged, by hand
    or (fsdp=True) by FSDP2 sharding over the cp ranks with activation checkpointing, which is how
    kiln.parallel.parallelize composes them. The cp group is given as a DeviceMesh, as there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from kiln.parallel.context import apply_context_parallel
    from kiln.parallel.parallelize import apply_activation_checkpointing

    model, inputs, targets = _setup(2)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    cp_model = apply_context_parallel(copy.deepcopy(model), mesh["cp"], True, backend)
    if fsdp:
        apply_activation_checkpointing(cp_model)
        for block in cp_model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(cp_model, mesh=mesh)
    ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cp_opt = torch.optim.AdamW(cp_model.parameters(), lr=1e-2)
    x, y, pos = shard_sequence(inputs, targets, rank, world, True)
    ref_losses, cp_losses = [], []
    for _ in range(steps):
        ref_loss = _loss(model(inputs), targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = _loss(cp_model(x, position_ids=pos), y)
        loss.backward()
        if not fsdp:
            for p in cp_model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world
        total = loss.detach().clone()
        dist.all_reduce(total)
        cp_opt.step()
        cp_opt.zero_grad()
        ref_losses.append(ref_loss.item())
        cp_losses.append(total.item() / world)
    params = [p.full_tensor() if fsdp else p for p in cp_model.parameters()]
    param_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), params))
    return {"ref": ref_losses, "cp": cp_losses, "param_diff": param_diff}


def _torch_backend_on_cpu(rank, world):
    """PyTorch's CP wiring (the CUDA backend) driven on CPU: either it fails at PyTorch's dispatch of the
    CPU flash kernel, as measured on torch 2.13, or (a later torch) its output must be right."""
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.parallel.context import _torch_attention_factory

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    attention = _torch_attention_factory(mesh["cp"], True)()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, SEQ, 8, generator=g) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    pos = sequence_positions(SEQ, rank, world, True)
    try:
        out = attention(q[:, :, pos], k[:, :, pos], v[:, :, pos], enable_gqa=True)
    except NotImplementedError as exc:
        return {"error": str(exc)}
    return {"diff": (out - ref[:, :, pos]).abs().max().item()}


def _worker(rank, world, init_file, out_file, cases, train_backend):
    from kiln.parallel.context import apply_context_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results = {}
    try:
        for backend, load_balance, kv_heads in cases:
            results[f"{backend}-{load_balance}-{kv_heads}"] = _compare(rank, world, backend, load_balance, kv_heads)
        if train_backend:
            results["train"] = _train(rank, world, train_backend)
            results["train-fsdp"] = _train(rank, world, train_backend, fsdp=True)
        for backend in ("torch", "bogus"):
            try:
                apply_context_parallel(_setup(2)[0], dist.group.WORLD, backend=backend)
                results[f"error-{backend}"] = ""
            except ConfigError as exc:
                results[f"error-{backend}"] = str(exc)
        if train_backend:  # last: it switches on PyTorch's process-wide CP dispatcher
            results["torch-on-cpu"] = _torch_backend_on_cpu(rank, world)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(results, f)


def _spawn(tmp_path, world, cases, train_backend=None):
    out = tmp_path / "results.json"
    # Forked workers start in under a second (spawned ones re-import torch: ~10 s each on a busy 2-core
    # machine). A process group in this process would be inherited by a fork, so then spawn instead.
    method = "spawn" if dist.is_initialized() else "fork"
    mp.start_processes(
        _worker,
        args=(world, str(tmp_path / "init"), str(out), cases, train_backend),
        nprocs=world,
        join=True,
        start_method=method,
    )
    return json.loads(out.read_text())


CASES_2 = [(backend, lb, kv) for backend in ("ring", "allgather") for lb in (True, False) for kv in (4, 2)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("cp2"), 2, CASES_2, train_backend="ring")


@pytest.mark.parametrize("backend,load_balance,kv_heads", CASES_2)
def test_cp2_matches_single_process(two_ranks, backend, load_balance, kv_heads):
    r = two_ranks[f"{backend}-{load_balance}-{kv_heads}"]
    assert backend in r["attention"] and f"load_balance={load_balance}" in r["attention"]
    assert r["grad_max"] > 1e-3  # the gradients compared are not trivially zero
    assert r["loss_diff"] < TOL and r["logit_diff"] < TOL and r["grad_diff"] < TOL, r


@pytest.mark.parametrize("run", ["train", "train-fsdp"])
def test_cp2_training_steps_match_single_process(two_ranks, run):
    r = two_ranks[run]
    assert r["ref"][-1] < r["ref"][0]  # it trained
    for ref, cp in zip(r["ref"], r["cp"]):
        assert abs(ref - cp) < TOL, r
    # Adam divides each gradient entry by its own running scale, so entries whose gradient is ~0 turn
    # a last-bit difference into a visible share of lr (1e-2): parameters agree to 1e-2 of one step.
    assert r["param_diff"] < 1e-4, r


def test_backend_errors_name_the_key(two_ranks):
    assert "parallel.cp_backend" in two_ranks["error-torch"] and "CUDA" in two_ranks["error-torch"]
    assert "parallel.cp_backend" in two_ranks["error-bogus"] and "ring" in two_ranks["error-bogus"]


def test_pytorch_context_parallel_on_cpu(two_ranks):
    r = two_ranks["torch-on-cpu"]
    if "error" in r:
        assert "_scaled_dot_product_flash_attention_for_cpu" in r["error"], r
    else:
        assert r["diff"] < TOL, r


def test_cp4_ring_and_allgather_match_single_process(tmp_path):
    """4 ranks: the ring makes three hops, so sending to the wrong neighbour or returning a key/value
    gradient to the wrong owner would show here (with 2 ranks both neighbours are the same rank)."""
    cases = [("ring", True, 2), ("ring", False, 4), ("allgather", True, 2)]
    results = _spawn(tmp_path, 4, cases)
    for backend, load_balance, kv_heads in cases:
        r = results[f"{backend}-{load_balance}-{kv_heads}"]
        assert r["loss_diff"] < TOL and r["logit_diff"] < TOL and r["grad_diff"] < TOL, (backend, r)
