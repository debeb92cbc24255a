"""The planner's memory model checked against the trainer: bytes of the tensors a real training step
holds, term by term, beside kiln.parallel.plan_check.trainer_memory's prediction for the same run.

One optimizer step of a built Trainer runs unchanged (its own train_step, loss and optimizer), watched:
- parameters and optimizer state: the distinct storages of model.parameters() and optimizer.state
  (after the step, when the state exists);
- gradients: the distinct grad storages at their peak, just before the optimizer step (accumulation
  adds into the same tensors, so that is also the most any micro-batch holds);
- autocast copies: the 16-bit copies made of parameters, seen at the dispatcher as `_to_copy` of a
  parameter's storage, that are still alive when the micro-batch's forward ends (autocast caches one
  copy per whole weight until its context exits; copies of slices live as long as autograd keeps them);
- saved activations: every storage autograd saves during one micro-batch's forward, each once at its
  full size (as kiln.model.activations does), less the parameters and autocast copies (their own
  terms); split into the blocks' ("activations") and what the embedding, final norm, head and loss
  save ("logits"), by forward hooks on the first and last block. The largest micro-batch counts.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.errors import ConfigError
from kiln.parallel.plan_check import TrainerMemory, trainer_memory
from kiln.train.trainer import Trainer

TERMS = tuple(f.name for f in dataclasses.fields(TrainerMemory))


def _storage_bytes(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is not None and isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
    return out


class _CastCopies(TorchDispatchMode):
    """Records the storages of the low-precision copies made of the given parameter storages."""

    def __init__(self, param_ptrs: set[int]):
        super().__init__()
        self.param_ptrs = param_ptrs
        self.copies: dict[int, tuple[int, StorageWeakRef]] = {}  # of the current micro-batch
        self.per_micro_batch: list[int] = []

    def holds(self, ptr: int) -> bool:
        """A live copy is at `ptr` (a freed copy's address may be reused by an activation)."""
        return ptr in self.copies and not self.copies[ptr][1].expired()

    def end_of_forward(self) -> None:
        """Count the copies still alive: autocast's cached ones, and copies of parameter slices (MoE
        experts, not cached) that autograd saved; a slice's copy inside a checkpointed block is gone."""
        self.per_micro_batch.append(sum(n for n, ref in self.copies.values() if not ref.expired()))
        self.copies = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if (
            func is torch.ops.aten._to_copy.default
            and isinstance(source, torch.Tensor)
            and source.untyped_storage().data_ptr() in self.param_ptrs
            and out.dtype != source.dtype
        ):
            storage = out.untyped_storage()
            self.copies[storage.data_ptr()] = (storage.nbytes(), StorageWeakRef(storage))
        return out


@dataclasses.dataclass
class _MicroBatch:
    saved: dict[str, dict[int, int]] = dataclasses.field(default_factory=lambda: {"blocks": {}, "other": {}})
    phase: str = "other"


def measure_step(trainer, micro_batches: list) -> TrainerMemory:
    """Bytes per term that `trainer.train_step(micro_batches)` holds (see the module doc). The step
    is a real one: the model and optimizer are updated."""
    if trainer.layout.mesh is not None:
        raise ConfigError("parallel", "the memory check measures the single-process layout only")
    if trainer._compile_loss:
        raise ConfigError("compile", "the memory check counts eager autograd's saved tensors: set compile = false")
    model, optimizer = trainer.model, trainer.optimizer
    params = _storage_bytes(model.parameters())
    # Buffers (RoPE tables) exist with or without a step; a saved view of one is no activation.
    held = set(params) | set(_storage_bytes(model.buffers()))
    current: list[_MicroBatch] = []
    casts = _CastCopies(set(params))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        mb = current[-1]
        for ptr, nbytes in _storage_bytes([tensor]).items():
            if ptr not in held and not casts.holds(ptr):
                mb.saved[mb.phase][ptr] = nbytes
        return tensor

    def set_phase(phase: str):
        def hook(*_):
            current[-1].phase = phase

        return hook

    loss_fn = trainer.loss_fn

    def watched_loss(forward_model, batch):
        current.append(_MicroBatch())
        out = loss_fn(forward_model, batch)
        casts.end_of_forward()
        return out

    grads = {}

    def before_step(*_):
        grads.update(_storage_bytes(p.grad for p in model.parameters()))

    hooks = [
        model.layers[0].register_forward_pre_hook(set_phase("blocks")),
        model.layers[-1].register_forward_hook(set_phase("other")),
        optimizer.register_step_pre_hook(before_step),
    ]
    trainer.loss_fn = watched_loss
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), casts:
            trainer.train_step(micro_batches)
    finally:
        trainer.loss_fn = loss_fn
        for h in hooks:
            h.remove()
    state = [t for s in optimizer.state.values() for t in s.values()]
    return TrainerMemory(
        params=sum(params.values()),
        grads=sum(grads.values()),
        optimizer=sum(_storage_bytes(state).values()),
        autocast=max(casts.per_micro_batch, default=0),
        activations=max(sum(mb.saved["blocks"].values()) for mb in current),
        logits=max(sum(mb.saved["other"].values()) for mb in current),
    )


class RandomTokens:
    """Uniformly random (inputs, targets) micro-batches: what a step holds depends on shapes only."""

    def __init__(self, vocab_size: int, seq_len: int, batch: int, seed: int = 0):
        self.vocab_size, self.seq_len, self.batch = vocab_size, seq_len, batch
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        while True:
            rows = torch.randint(0, self.vocab_size, (self.batch, self.seq_len + 1), generator=self.generator)
            yield rows[:, :-1], rows[:, 1:]


def check_config(model_cfg, train_cfg, out_dir) -> list[tuple[str, float, float, float]]:
    """Build a Trainer for `model_cfg` and `train_cfg` on the CPU over random tokens (vocab_size must
    be set), run one measured step and return check_rows(planner, measured). `out_dir` receives
    nothing but the trainer's empty checkpoint folder."""
    if model_cfg.vocab_size <= 0:
        raise ConfigError("model.vocab_size", "the memory check needs a vocabulary size (no pack is read)")
    source = RandomTokens(model_cfg.vocab_size, train_cfg.seq_len, train_cfg.micro_batch_size)
    trainer = Trainer(model_cfg, train_cfg, None, out_dir, resume="none", device="cpu", data=(source, source))
    batches = iter(source)
    measured = measure_step(trainer, [next(batches) for _ in range(trainer.accum_steps)])
    return check_rows(predicted_step(trainer), measured)


def predicted_step(trainer) -> TrainerMemory:
    """The planner's prediction for the trainer's model, precision, micro-batch, sequence length,
    optimizer and activation checkpointing (kiln.parallel.plan_check.trainer_memory)."""
    cfg = trainer.cfg
    return trainer_memory(
        trainer.model_cfg,
        precision=cfg.precision,
        micro_batch=cfg.micro_batch_size,
        seq_len=cfg.seq_len,
        ac=cfg.activation_checkpointing,
        optimizer=cfg.optimizer,
    )


def check_rows(predicted: TrainerMemory, measured: TrainerMemory) -> list[tuple[str, float, float, float]]:
    """(term, predicted bytes, measured bytes, predicted / measured - 1) per term, then the total."""
    rows = []
    for name in (*TERMS, "total"):
        p, m = getattr(predicted, name), getattr(measured, name)
        rows.append((name, p, m, (p / m - 1) if m else (0.0 if p == 0 else float("inf"))))
    return rows


def format_rows(rows) -> str:
    lines = [f"  {'term':<12} {'planner':>12} {'measured':>12} {'error':>8}"]
    for name, p, m, err in rows:
        lines.append(f"  {name:<12} {p:>12,.0f} {m:>12,.0f} {err:>+8.1%}")
    return "\n".join(lines)
