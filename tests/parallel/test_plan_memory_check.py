"""The planner's memory model against the tensors a real trainer step holds (kiln.train.memcheck).

Each case builds a Trainer on CPU (the single-process layout: the trainer builds a one-rank mesh only
for GPU offload, which CPU refuses), runs one optimizer step and compares every term of
kiln.parallel.plan_check.trainer_memory with the bytes measured: within 10% for each term and the total,
and for the dense model to the byte but for AdamW's per-tensor step counters (4 bytes each)."""

from __future__ import annotations

import pytest

from kiln.errors import ConfigError
from kiln.model import ModelConfig
from kiln.parallel.plan import MEGATRON, Layout, Workload, layer_activation_bytes, memory
from kiln.parallel.plan_check import trainer_memory
from kiln.train.config import TrainConfig
from kiln.train.memcheck import TERMS, check_config, check_rows, format_rows, measure_step, predicted_step
from kiln.train.trainer import Trainer

DENSE = dict(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
MOE = dict(DENSE, n_experts=4, moe_top_k=2, moe_every=2)
SEQ, MICRO = 32, 2

CASES = [
    ("dense", precision, ac, accum) for precision in ("fp32", "bf16") for ac in ("none", "full") for accum in (1, 2)
] + [("moe", "bf16", "none", 2), ("moe", "bf16", "full", 1), ("moe", "fp32", "none", 1)]
# Each precision, checkpointing mode and model kind once in the default suite, with both accumulations.
FAST = {
    ("dense", "fp32", "none", 1),
    ("dense", "fp32", "full", 2),
    ("dense", "bf16", "none", 2),
    ("moe", "bf16", "full", 1),
}


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("memcheck") / "pack")


def _trainer(pack, out, model: dict, **train) -> Trainer:
    cfg = TrainConfig(seq_len=SEQ, micro_batch_size=MICRO, max_steps=2, warmup_steps=1, **train)
    return Trainer(ModelConfig(**model), cfg, pack, out, resume="none")


def _measure(trainer: Trainer):
    batches = iter(trainer.train_loader)
    micro_batches = [next(batches) for _ in range(trainer.accum_steps)]
    return measure_step(trainer, micro_batches)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES],
    ids=lambda c: "-".join(map(str, c)),
)
def test_planner_memory_matches_the_trainer_step(case, pack, tmp_path):
    kind, precision, ac, accum = case
    trainer = _trainer(
        pack,
        tmp_path,
        DENSE if kind == "dense" else MOE,
        precision=precision,
        activation_checkpointing=ac,
        global_batch_tokens=SEQ * MICRO * accum,
    )
    assert trainer.accum_steps == accum
    measured = _measure(trainer)
    predicted = predicted_step(trainer)
    rows = check_rows(predicted, measured)
    print(f"\n{kind} {precision} ac={ac} accum={accum}\n{format_rows(rows)}")
    for name, p, m, err in rows:
        assert m > 0 or (name == "autocast" and precision == "fp32"), name
        assert abs(err) <= 0.10, f"{name}: planner {p:,.0f} vs measured {m:,.0f} bytes ({err:+.1%})"
    # What the planner leaves out: one float32 step counter per parameter tensor (AdamW); and for
    # MoE the routing bookkeeping (expert indices, gate products) the formula does not itemise.
    n_tensors = sum(1 for _ in trainer.model.parameters())
    assert measured.optimizer - predicted.optimizer == 4 * n_tensors
    exact = TERMS if kind == "dense" else ("params", "grads", "autocast", "logits")
    for name in exact:
        if name != "optimizer":
            assert getattr(measured, name) == pytest.approx(getattr(predicted, name), abs=4), name


def test_accumulation_holds_one_micro_batch_of_activations(pack, tmp_path):
    """Two micro-batches per step hold what one does: gradients accumulate into the same tensors and
    each micro-batch's activations are freed by its backward before the next forward."""
    one = _measure(_trainer(pack, tmp_path / "one", DENSE, global_batch_tokens=SEQ * MICRO))
    two = _measure(_trainer(pack, tmp_path / "two", DENSE, global_batch_tokens=2 * SEQ * MICRO))
    assert one == two


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("optimizer", ["lion", "adafactor", "muon"])
def test_each_optimizers_state_is_what_the_planner_counts(optimizer, model, pack, tmp_path):
    """Lion keeps one value per parameter; Adafactor a row and a column vector per matrix; Muon one
    momentum per block matrix (the MoE router and shared expert included) and AdamW's two moments for
    everything else (the 3-D expert banks included). What is left over is the step counters: one
    float32 per tensor of AdamW's and Adafactor's, none of Lion's or Muon's."""
    trainer = _trainer(
        pack, tmp_path, DENSE if model == "dense" else MOE, global_batch_tokens=SEQ * MICRO, optimizer=optimizer
    )
    measured, predicted = _measure(trainer), predicted_step(trainer)
    params = list(trainer.model.parameters())
    if optimizer == "lion":
        assert predicted.optimizer == measured.params
    counted = {
        "lion": 0,
        "adafactor": len(params),
        "muon": len(trainer.optimizer.adamw.state) if optimizer == "muon" else 0,
    }
    assert measured.optimizer - predicted.optimizer == 4 * counted[optimizer]


def test_refusals(pack, tmp_path):
    trainer = _trainer(pack, tmp_path, DENSE, global_batch_tokens=SEQ * MICRO, compile=True)
    with pytest.raises(ConfigError, match="compile"):
        _measure(trainer)
    cfg = ModelConfig(**DENSE)
    with pytest.raises(ConfigError, match="optimizer"):
        trainer_memory(cfg, "bf16", 1, SEQ, optimizer="sgd")
    with pytest.raises(ConfigError, match="precision"):
        trainer_memory(cfg, "fp8", 1, SEQ)
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        trainer_memory(cfg, "bf16", 1, SEQ, ac="selective")


@pytest.mark.parametrize("ac", ["none", "full"])
def test_gpu_planner_without_fsdp_counts_what_the_trainer_holds(ac):
    """memory() for one GPU without FSDP (zero=0) counts the model states, autocast's weight copies
    (in `buffers`) and the fp32 checkpointed inputs that trainer_memory, checked above against real
    steps, counts; Megatron's bf16 weights have no copies."""
    cfg, tokens = ModelConfig(**DENSE), SEQ * MICRO
    mem = memory(cfg, Layout(ac=ac, micro_batch=MICRO), Workload(SEQ, tokens))
    kiln = trainer_memory(cfg, "bf16", MICRO, SEQ, ac=ac)
    assert mem.params + mem.grads + mem.optimizer == kiln.params + kiln.grads + kiln.optimizer
    assert mem.buffers == kiln.autocast
    # trainer_memory adds the bf16 RoPE tables (memory() counts the fp32 statistics itself).
    extra = 2 * SEQ * cfg.head_dim * 2
    if ac == "full":  # memory() adds the block that backward recomputes, which is not held in forward
        assert mem.activations - layer_activation_bytes(cfg, SEQ, tokens) + extra == kiln.activations
    else:
        assert mem.activations + extra == kiln.activations
    assert memory(cfg, Layout(ac=ac, micro_batch=MICRO), Workload(SEQ, tokens), MEGATRON).buffers == 0


def test_check_config_runs_over_random_tokens(tmp_path):
    """The bench's entry point: no pack, one measured step, rows for every term and the total."""
    train = TrainConfig(seq_len=SEQ, micro_batch_size=MICRO, global_batch_tokens=2 * SEQ * MICRO, warmup_steps=1)
    rows = check_config(ModelConfig(**DENSE), train, tmp_path / "run")
    assert [r[0] for r in rows] == [*TERMS, "total"]
    assert all(abs(err) < 0.001 for *_, err in rows)
    with pytest.raises(ConfigError, match="vocab_size"):
        check_config(ModelConfig(**{**DENSE, "vocab_size": 0}), train, tmp_path / "none")
