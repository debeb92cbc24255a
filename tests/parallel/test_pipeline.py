"""Pipeline parallelism (kiln/parallel/pipeline.py) against one process running the whole model."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import ConfigError
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.parallel.config import ParallelConfig
from kiln.parallel.pipeline import (
    bubble_fraction,
    build_pipeline_schedule,
    pipeline_eval_step,
    pipeline_train_step,
    split_layers,
    split_model,
)

BATCH, SEQ = 8, 16


def tiny_cfg(**overrides) -> ModelConfig:
    fields = dict(vocab_size=97, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=SEQ)
    fields.update(overrides)
    return ModelConfig(**fields)


def chain(stages, tokens):
    x = tokens
    for stage in stages:
        x = stage(x)
    return x


def all_stages(model, pp, v):
    """Every stage of every rank, in stage order."""
    stages = [s for rank in range(pp) for s in split_model(model, rank, pp, v)]
    return sorted(stages, key=lambda s: s.stage_index)


# ---- splitting (one process) ------------------------------------------------------------------


def test_split_layers_even_uneven_and_head_weight():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]  # tie: the earlier stage
    assert split_layers(5, 2, head_weight=0.5) == [range(0, 3), range(3, 5)]
    assert split_layers(4, 2, head_weight=1.5) == [range(0, 3), range(3, 4)]
    assert split_layers(8, 4, head_weight=2.0) == [range(0, 3), range(3, 5), range(5, 7), range(7, 8)]
    assert split_layers(8, 4, embed_weight=1.0, head_weight=1.0) == [range(0, 2), range(2, 5), range(5, 7), range(7, 8)]


@pytest.mark.parametrize(
    "n_layers,n_stages,embed,head",
    [(7, 3, 0.0, 0.0), (9, 4, 0.5, 2.3), (10, 3, 1.0, 0.2), (6, 6, 0.0, 1.0), (11, 4, 0.0, 3.0)],
)
def test_split_layers_minimises_the_largest_stage(n_layers, n_stages, embed, head):
    def cost(counts):
        extra = [embed] + [0.0] * (n_stages - 2) + [head] if n_stages > 1 else [embed + head]
        return max(c + e for c, e in zip(counts, extra))

    # Brute force over every way to give each stage at least one layer.
    best = min(cost(c) for c in itertools.product(range(1, n_layers + 1), repeat=n_stages) if sum(c) == n_layers)
    ranges = split_layers(n_layers, n_stages, embed, head)
    assert [r.start for r in ranges] == [0] + [r.stop for r in ranges[:-1]] and ranges[-1].stop == n_layers
    assert cost([len(r) for r in ranges]) == pytest.approx(best)


def test_more_stages_than_layers_names_parallel_pp():
    model = build_model(tiny_cfg(n_layers=3))
    with pytest.raises(ConfigError) as err:
        split_model(model, 0, 2, stages_per_rank=2)
    assert err.value.key == "parallel.pp"


def test_tied_embeddings_are_refused():
    model = build_model(tiny_cfg(tie_embeddings=True))
    with pytest.raises(ConfigError) as err:
        split_model(model, 0, 2)
    assert err.value.key == "model.tie_embeddings"
    assert len(split_model(model, 0, 1)) == 1  # one stage holds both ends: nothing to split


def test_stages_keep_the_unsplit_parameter_names():
    model = build_model(tiny_cfg(n_layers=5))
    stages = all_stages(model, pp=2, v=2)
    assert [s.stage_index for s in stages] == [0, 1, 2, 3]
    assert [s.layers.indices for s in stages] == [[0, 1], [2], [3], [4]]
    keys = [k for s in stages for k in s.state_dict()]
    assert len(keys) == len(set(keys))
    assert set(keys) == set(model.state_dict())
    full = dict(model.named_parameters())
    for stage in stages:
        for name, param in stage.named_parameters():
            assert param is full[name]
    # Rank 0 of a loop placement holds stages 0 and 2.
    assert [s.stage_index for s in split_model(model, 0, 2, 2)] == [0, 2]


def test_stage_layers_read_like_a_module_list():
    from kiln.parallel.parallelize import apply_activation_checkpointing

    model = build_model(tiny_cfg())
    tokens = torch.randint(0, 97, (2, SEQ))
    expected = model(tokens)
    stages = all_stages(model, 2, 1)
    for stage in stages:  # code written for the whole model's ModuleList runs on a stage as is
        apply_activation_checkpointing(stage)
    assert torch.equal(chain(stages, tokens), expected)
    stage = stages[1]
    assert len(stage.layers) == 2 and list(stage.layers) == [model.layers[2], model.layers[3]]
    replacement = torch.nn.Identity()
    stage.layers[1] = replacement
    assert stage.layers[1] is replacement and dict(stage.layers.named_children())["3"] is replacement


@pytest.mark.parametrize(
    "overrides", [{}, {"pos": "learned"}, {"pos": "sinusoidal", "norm": "layernorm", "ffn": "gelu"}, {"n_layers": 5}]
)
def test_chained_stages_equal_the_model(overrides):
    model = build_model(tiny_cfg(**overrides))
    tokens = torch.randint(0, 97, (2, SEQ))
    expected = model(tokens)
    for pp, v in ((1, 1), (2, 1), (2, 2)):
        assert torch.equal(chain(all_stages(model, pp, v), tokens), expected), (pp, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(chain(all_stages(model, 2, 1), tokens), model(tokens))


def test_schedule_config_errors_name_the_key():
    model = build_model(tiny_cfg())
    one_stage = split_model(model, 0, 2)
    with pytest.raises(ConfigError) as err:
        build_pipeline_schedule(
            one_stage, None, ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)
        )
    assert err.value.key == "parallel.pp_stages_per_rank"
    with pytest.raises(ConfigError) as err:
        build_pipeline_schedule(
            split_model(model, 0, 2, 2),
            None,
            ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2, pp_microbatches=5),
        )
    assert err.value.key == "parallel.pp_microbatches"


# ---- bubble fraction ------------------------------------------------------------------------


def _simulate(orders, forward_time=1, backward_time=2):
    """Idle share of rank 0 when each rank runs its forward/backward actions in the given order,
    each starting once its inputs exist: F(s, i) after F(s-1, i); B(s, i) after F(s, i) and
    B(s+1, i). Actions are (kind, stage, microbatch)."""
    n_stages = 1 + max(stage for order in orders for _, stage, _ in order)
    finished, position, clock = {}, [0] * len(orders), [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                kind, stage, mb = order[position[rank]]
                deps = (
                    ([("F", stage - 1, mb)] if stage > 0 else [])
                    if kind == "F"
                    else [("F", stage, mb)] + ([("B", stage + 1, mb)] if stage < n_stages - 1 else [])
                )
                if any(d not in finished for d in deps):
                    break
                start = max([clock[rank]] + [finished[d] for d in deps])
                clock[rank] = finished[(kind, stage, mb)] = start + (forward_time if kind == "F" else backward_time)
                position[rank] += 1
                moved = True
    assert position == [len(o) for o in orders], "schedule deadlocked"
    work = sum(forward_time if k == "F" else backward_time for k, _, _ in orders[0])
    return 1 - work / max(clock)


def _one_f_one_b(p, m):
    """The 1F1B order of Narayanan et al. 2021 (fig. 4): p-1-r warm-up forwards, then alternate."""
    orders = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [("F", r, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", r, warmup + i), ("B", r, i)]
        order += [("B", r, i) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _pytorch_orders(schedule_class, p, m, v):
    """The action lists PyTorch's own schedule builds for each rank."""
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    from torch.distributed.pipelining.schedules import _ComputationType

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    ops = visualizer.get_schedule_ops(schedule_class, p, m, v)
    return [
        [
            (kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in row
            if a is not None and a.computation_type in kinds
        ]
        for row in ops
    ]


def test_bubble_fraction_matches_the_paper_and_simulated_schedules():
    # Narayanan et al. 2021 state the bubble relative to the ideal time: (p-1)/m and (p-1)/(v m).
    for p, m, v in ((2, 4, 1), (4, 8, 1), (8, 32, 1), (4, 8, 2), (4, 16, 4)):
        for name in ("gpipe", "1f1b", "interleaved_1f1b"):
            share = bubble_fraction(name, p, m, v)
            chunks = v if name == "interleaved_1f1b" else 1
            assert share / (1 - share) == pytest.approx((p - 1) / (chunks * m))
    assert bubble_fraction("1f1b", 1, 4) == 0.0
    # The same numbers from timing the schedules action by action.
    for p, m in ((2, 4), (4, 8), (4, 4)):
        assert _simulate(_one_f_one_b(p, m)) == pytest.approx(bubble_fraction("1f1b", p, m))
        assert _simulate(_pytorch_orders("GPipe", p, m, 1)) == pytest.approx(bubble_fraction("gpipe", p, m))
    for p, m, v in ((2, 8, 2), (4, 8, 2), (4, 16, 4), (2, 4, 3)):
        simulated = _simulate(_pytorch_orders("Interleaved1F1B", p, m, v), 1, 1)
        assert simulated == pytest.approx(bubble_fraction("interleaved_1f1b", p, m, v)), (p, m, v)
    with pytest.raises(ConfigError):
        bubble_fraction("zero_bubble", 2, 4)


# ---- two processes against one ----------------------------------------------------------------

STEPS = 2
MOE = {"moe_every": 2, "n_experts": 4, "moe_top_k": 2}  # layers 1 and 3: one MoE layer per stage
# (schedule, stages per rank, model overrides). Every case runs in the same two processes, one after
# the other: starting processes (importing torch) costs more here than the pipelines themselves.
CASES = {
    "gpipe": ("gpipe", 1, {}),
    "1f1b": ("1f1b", 1, {}),
    "interleaved_1f1b": ("interleaved_1f1b", 2, {}),
    "1f1b-uneven-5-layers": ("1f1b", 1, {"n_layers": 5}),
    "1f1b-moe": ("1f1b", 1, MOE),
}
# Blocks of each stage, per rank: interleaving places stages loop-style (rank 0 holds stages 0 and 2).
LAYOUTS = {
    "gpipe": [[[0, 1]], [[2, 3]]],
    "1f1b": [[[0, 1]], [[2, 3]]],
    "interleaved_1f1b": [[[0], [2]], [[1], [3]]],
    "1f1b-uneven-5-layers": [[[0, 1, 2]], [[3, 4]]],
    "1f1b-moe": [[[0, 1]], [[2, 3]]],
}


def _reference_step(model, inputs, targets, microbatches):
    """The single-process training loss and gradients. Dense: one pass over the whole batch. MoE:
    the load balance loss is not additive over tokens, so the reference is gradient accumulation
    over the same microbatches, each adding (cross-entropy + auxiliary loss) / microbatches; the
    loss is the mean of those sums, what a single process logs."""
    from kiln.model.moe import moe_aux_loss, moe_layers

    if not moe_layers(model):
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()
        return loss.item()
    losses = []
    for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches)):
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) + moe_aux_loss(model)
        (loss / microbatches).backward()
        losses.append(loss.item())
    return sum(losses) / microbatches


def _run_case(rank, world, pp_group_or_mesh, schedule_name, stages_per_rank, overrides):
    torch.manual_seed(0)
    cfg = tiny_cfg(**overrides)
    reference = build_model(cfg)
    model = build_model(cfg)
    model.load_state_dict(reference.state_dict())
    pcfg = ParallelConfig(pp=world, pp_schedule=schedule_name, pp_stages_per_rank=stages_per_rank)
    stages = split_model(model, rank, world, stages_per_rank)
    schedule = build_pipeline_schedule(stages, pp_group_or_mesh, pcfg, device="cpu")
    is_first = any(s.is_first for s in stages)
    is_last = any(s.is_last for s in stages)
    owned = {name: p for s in stages for name, p in s.named_parameters()}
    ref_params = dict(reference.named_parameters())

    result = {"owned": sorted(owned), "losses": [], "ref_losses": [], "grad_diff": []}
    result["layers"] = [s.layers.indices for s in stages]
    try:  # a batch the microbatches do not divide is refused before any communication
        pipeline_train_step(
            schedule,
            torch.zeros(BATCH - 2, SEQ, dtype=torch.long),
            torch.zeros(BATCH - 2, SEQ, dtype=torch.long),
            is_first,
            is_last,
        )
    except ConfigError as err:
        result["uneven_batch_error"] = err.key

    # Adam's first update is about lr * sign(grad), so where a gradient is near zero its rounding
    # difference (microbatch sums vs one batch, ~1e-8) can move a weight by a sizeable part of lr:
    # after two steps that measured 1.7e-5 at lr=1e-2 and 5.5e-6 at 1e-3. At 3e-4 it stays well
    # under 1e-5, while a parameter the optimizer missed would still be off by 6e-4.
    opt = torch.optim.AdamW(owned.values(), lr=3e-4, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        ref_opt.zero_grad()
        ref_loss = _reference_step(reference, inputs, targets, pcfg.microbatches)
        opt.zero_grad()
        loss = pipeline_train_step(schedule, inputs, targets, is_first, is_last)
        result["losses"].append(None if loss is None else loss.item())
        result["ref_losses"].append(ref_loss)
        result["grad_diff"].append(max((owned[n].grad - ref_params[n].grad).abs().max().item() for n in owned))
        opt.step()
        ref_opt.step()
    result["param_diff"] = {n: (owned[n] - ref_params[n]).abs().max().item() for n in owned}

    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    loss = pipeline_eval_step(schedule, inputs, targets, is_first, is_last)
    with torch.no_grad():
        ref_loss = torch.stack(
            [
                F.cross_entropy(reference(x).flatten(0, 1), y.flatten())
                for x, y in zip(inputs.chunk(pcfg.microbatches), targets.chunk(pcfg.microbatches))
            ]
        ).mean()
    result["eval_loss"] = None if loss is None else [loss.item(), ref_loss.item()]
    return result


def _worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    torch.set_num_threads(1)  # two processes on two cores
    # A bounded timeout turns a pipeline deadlock into an error instead of a hung test.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
        results = {}
        for case, args in CASES.items():
            # Both ways to name the pipeline ranks: the default group, and a "pp" device mesh.
            results[case] = _run_case(rank, world, mesh if case in ("interleaved_1f1b", "1f1b-moe") else None, *args)
            dist.barrier()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("pp")
    mp.spawn(_worker, args=(2, str(out / "init"), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_matches_single_process(pipeline_results, case):
    _, stages_per_rank, overrides = CASES[case]
    results = [rank_results[case] for rank_results in pipeline_results]
    world = len(results)
    m = ParallelConfig(pp=world, pp_stages_per_rank=stages_per_rank).microbatches
    assert BATCH % m == 0 and m > 1  # the test exercises real microbatching

    # Every parameter lives on exactly one rank, every block on exactly one stage.
    owned = [name for r in results for name in r["owned"]]
    assert len(owned) == len(set(owned))
    assert set(owned) == set(dict(build_model(tiny_cfg(**overrides)).named_parameters()))
    assert [r["layers"] for r in results] == LAYOUTS[case]

    for rank, r in enumerate(results):
        assert r["uneven_batch_error"] == "parallel.pp_microbatches"
        assert max(r["grad_diff"]) < 1e-5, (rank, r["grad_diff"])
        worst = max(r["param_diff"], key=r["param_diff"].get)
        assert r["param_diff"][worst] < 1e-5, (rank, worst, r["param_diff"][worst])
        has_last = rank == world - 1  # loop placement: the last stage is always on the last rank
        # Every stage of the MoE case holds an MoE layer, so every rank has a share of the loss.
        assert (r["losses"][0] is not None) == (has_last or bool(overrides.get("moe_every")))
        assert (r["eval_loss"] is not None) == has_last
        if has_last:
            loss, ref_loss = r["eval_loss"]  # validation: the cross-entropy alone
            assert loss == pytest.approx(ref_loss, abs=1e-5)
    # The ranks' shares add up to the single-process training loss (with MoE: cross-entropy plus
    # every stage's load-balance and z-losses).
    for step in range(STEPS):
        shares = [r["losses"][step] for r in results if r["losses"][step] is not None]
        assert sum(shares) == pytest.approx(results[-1]["ref_losses"][step], abs=1e-5), step
