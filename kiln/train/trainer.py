"""The training loop shared by every training stage.

Pretraining uses the default objective (next-token cross entropy); later stages pass their own
`loss_fn(model, batch) -> (mean loss over the batch's counted tokens, number of counted tokens)`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from kiln.errors import ConfigError
from kiln.files import write_text_atomic
from kiln.model import ModelConfig, build_model, flops_per_token
from kiln.model.config import arch_of
from kiln.parallel.config import ParallelConfig
from kiln.parallel.parallelize import apply_activation_checkpointing
from kiln.progress import progress_enabled
from kiln.storage import is_remote
from kiln.train.config import TrainConfig
from kiln.train.guard import GRAD_GROUPS, LossGuard, grad_group, group_grad_norms, respond
from kiln.train.metrics import MetricsLogger, detect_peak_flops, model_flops_utilization, peak_memory_mb
from kiln.train.objective import LossFn, chunked_next_token_loss, next_token_loss
from kiln.train.offload import NVMeAdamW
from kiln.train.optim import build_optimizer
from kiln.train.precision import PRECISION_DTYPES, autocast, convert_to_fp8
from kiln.train.schedule import lr_at
from kiln.train.seq_warmup import check_applies, split_windows, window_len_at
from kiln.train.system import prime_system_metrics, system_metrics
from kiln.train.trainer_eval import Validation, _local, validation_line  # noqa: F401 (validation_line: re-exported)
from kiln.train.trainer_setup import Setup
from kiln.train.trainer_state import Checkpointing
from kiln.train.watchdog import Watchdog

# Full activation checkpointing runs each block's forward twice. Training costs ~3 forwards per token
# (forward 2N FLOPs, backward 4N: gradients of activations and of weights); recomputing the forward
# adds one more, so the hardware does 4/3 of the model FLOPs (Korthikanti et al. 2022, sec. 5). The
# output head, which is not recomputed, makes the true factor slightly smaller.
RECOMPUTE_FACTOR = 4 / 3


def recompute_factor(cfg: ModelConfig, seq_len: int, mode: str) -> float:
    """Hardware FLOPs over model FLOPs under activation checkpointing `mode`. Selective checkpointing
    (kiln.parallel.parallelize.selective_policy) recomputes, of the matmuls and attention, only each
    block's output projection wo, 2 * dim * n_heads * head_dim FLOPs per token per layer, and in an
    MoE layer each routed expert's down projection, 2 * dim * moe_hidden per routed copy (the norms,
    RoPE and SiLU it also recomputes are elementwise, which MFU does not count either)."""
    if mode == "full":
        return RECOMPUTE_FACTOR
    if mode == "selective":
        moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.n_layers))
        rerun = cfg.dim * cfg.n_heads * cfg.head_dim * cfg.n_layers
        rerun += moe_layers * cfg.moe_top_k * cfg.dim * cfg.moe_hidden_size
        return 1.0 + 2.0 * rerun / flops_per_token(cfg, seq_len)
    return 1.0


# The first step of a session also compiles (torch.compile) and warms up allocators and
# communicators: it gets this many times the watchdog's timeout.
FIRST_STEP_WATCHDOG_FACTOR = 10


class Trainer(Setup, Checkpointing, Validation):
    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        pack_dir,
        out_dir,
        recipe_dict: dict | None = None,
        resume: str = "auto",
        init_from=None,
        loss_fn: LossFn | None = None,
        device: str | None = None,
        parallel: ParallelConfig | None = None,
        data: tuple | None = None,
        prepare_model: Callable[[torch.nn.Module], object] | None = None,
        eval_loss_fn: LossFn | None = None,
        after_fit: Callable[[Trainer], object] | None = None,
        wrap_data: Callable[[object], object] | None = None,
    ):
        """`data`: a stage's own (train, val) batch sources instead of the pack's; a source with a
        `bind(trainer)` method is bound to this trainer once it is built (online sources sample
        from the live model). `after_fit(trainer)` runs at the end of fit(), while the metrics
        logger is still open. `wrap_data(source)`: the pack's train and val sources as the
        objective reads them (masked-LM masking for BERT: kiln.train.objective.masked_lm_objective).
        A model_cfg of another family than the decoder ([model] arch) needs its loss_fn."""
        train_cfg.validate()
        arch = arch_of(model_cfg)
        if arch != "decoder" and loss_fn is None:
            raise ConfigError("model.arch", f"{arch!r} has no next-token objective; pass its loss_fn")
        cfg = self.cfg = train_cfg
        self.pack_dir = pack_dir if pack_dir is None or is_remote(pack_dir) else Path(pack_dir)
        self.out_dir = Path(out_dir)
        self.recipe_dict = recipe_dict
        if cfg.loss_chunk_tokens and loss_fn is not None:
            raise ConfigError(
                "train.loss_chunk_tokens", "chunks the pretraining next-token loss; this stage brings its own loss"
            )
        self.loss_fn = loss_fn or (
            chunked_next_token_loss(cfg.loss_chunk_tokens) if cfg.loss_chunk_tokens else next_token_loss
        )
        self.eval_loss_fn = eval_loss_fn or self.loss_fn
        self.after_fit = after_fit
        self._place(device, parallel, model_cfg, arch)
        cfg = self.cfg  # _place resolved precision "auto"
        if self.layout.pipelined and loss_fn is not None:
            raise ConfigError("parallel.pp", "pipeline parallelism runs the pretraining loss only")
        if cfg.seq_len_warmup_steps:
            custom = loss_fn is not None or data is not None or wrap_data is not None
            check_applies(custom, self.layout.pipelined, self.layout.dims.cp, self.layout.dims.tp)
        self._batch_geometry()
        self._open_data(data, wrap_data)
        self.model_cfg = self._sized_model_cfg(model_cfg)

        self.compute_dtype = PRECISION_DTYPES[cfg.precision]
        if cfg.precision == "fp8":
            self._check_fp8_layout()
        # Before seeding, and with its own generator: the measurement must not change the init.
        self.peak_flops = detect_peak_flops(self.device, self.compute_dtype, cfg.peak_flops)
        self.flops_per_token = flops_per_token(self.model_cfg, cfg.seq_len)
        self.recompute_factor = recompute_factor(self.model_cfg, cfg.seq_len, cfg.activation_checkpointing)

        torch.manual_seed(cfg.seed)
        self.model = build_model(self.model_cfg, device=self.device)
        self.model.train()
        self._open_checkpoints()
        # Dynamic loss scaling keeps small fp16 gradients from flushing to zero; bf16 has fp32's
        # exponent range and needs none. A disabled scaler passes everything through unchanged.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.precision == "fp16")
        self._start_loop_state()
        # Under fp16 the grad scaler owns overflowing gradients (it skips the step and backs off).
        self.guard = LossGuard(cfg.guard, scaler_handles_overflow=cfg.precision == "fp16")
        found = self._load_weights(resume, init_from, prepare_model)
        self._convert_for_precision()
        # Layer groups of the trained parameters, from the whole model (a pipeline rank later holds
        # only its stages), so every rank computes the same groups' norms.
        present = {grad_group(n) for n, p in self.model.named_parameters() if p.requires_grad}
        self.grad_groups = [g for g in GRAD_GROUPS if g in present]
        self._wrap_for_training()
        self.optimizer = build_optimizer(self.model, cfg, offload_dir=self.out_dir / "optimizer_offload")
        self.resumed_from = self._resume(found, init_from) if found is not None else None
        self.metrics = self._metrics_logger() if self.is_main else None
        for source in {id(s): s for s in (self.train_loader, self.val_loader)}.values():
            if hasattr(source, "bind"):
                source.bind(self)

    # ---- setup -----------------------------------------------------------------------------------

    def _load_weights(self, resume: str, init_from, prepare_model) -> tuple | None:
        """Loads the weights the run starts from; returns the checkpoint being resumed, or None.

        Full weights (a single-file checkpoint, or init_from) load before the model is split, so
        they fit any layout; sharded checkpoints load after, through DCP, which reshards.
        prepare_model (e.g. adding LoRA weights) runs after the base weights of init_from load, but
        before a resumed checkpoint's, which already holds the added weights."""
        found = self._find_checkpoint(resume)
        if found is None and init_from is not None:
            self._init_from(init_from)
        elif found is None and self.cfg.replay.fraction > 0 and self.is_main:
            # Allowed: a fresh model on a two-pack mixture is a mixture, not continual pretraining.
            print(
                f"train.replay without init_from: a new model trains on {self.pack_dir} mixed with {self.cfg.replay.pack}"
            )
        if prepare_model is not None:
            prepare_model(self.model)
        if found is not None and found[2] is not None:
            self.model.load_state_dict(found[2])
        return found

    def _convert_for_precision(self) -> None:
        """fp8 swaps block linears for Float8Linear before checkpointing, compile and sharding wrap
        them (torchtitan's order); the swap keeps parameter names, so it may follow the loads."""
        cfg = self.cfg
        note = cfg.warmup_note()
        if note and self.is_main:
            print(note)
        self.fp8_linears = 0
        if cfg.precision == "fp8":
            self.fp8_linears, left_out = convert_to_fp8(self.model, cfg.fp8_recipe)
            if left_out and self.is_main:
                print(
                    f"fp8: {len(left_out)} block linears keep bf16 (a dim not divisible by 16): {', '.join(left_out)}"
                )

    def _wrap_for_training(self) -> None:
        """Activation checkpointing, compile and the parallel layout, applied to the plain model.

        Compiling the loss function (which calls the model) puts the output head and the loss in
        one graph, so the float32 upcast and log-softmax fuse instead of writing a float32 copy of
        every logit: bf16 steps ~1.13x faster than compiling the model alone (docs/benchmarks.md).
        Under a device mesh the blocks are compiled one by one instead (kiln.parallel), so the
        sharding hooks stay outside the graphs. Evaluation stays eager: it runs rarely."""
        cfg = self.cfg
        self._compile_loss = cfg.compile and self.layout.mesh is None
        self._compiled_loss = (None, None)  # (loss_fn it was compiled from, compiled function)
        if self.layout.mesh is None:
            apply_activation_checkpointing(self.model, cfg.activation_checkpointing)
        # Training calls go through forward_model (the model, or its DDP wrapper); state is always
        # read from self.model, whose parameter names no wrapper prefixes.
        self.model, self.forward_model = self.layout.parallelize(
            self.model, self.compute_dtype, cfg.activation_checkpointing, compile_blocks=cfg.compile
        )

    def _start_loop_state(self) -> None:
        """The loop's counters at step 0 (a resumed run overwrites them from its checkpoint)."""
        self.step = 0
        self.tokens_seen = 0
        self.best_val_loss = math.inf
        self.best_val_bpb = math.inf
        self.best_step = -1
        self.evals_since_best = 0
        self.last_val_loss = None
        self.last_val_bpb = None
        self.last_val_tokens = None  # what the last evaluation covered
        self.last_val_sequences = None
        self.last_replay_val = None  # the replay pack's split at the last evaluation ({"val_loss/replay": ...})
        self.stopped_early = False
        self.lr_scale = 1.0  # lowered by the guard's rollbacks (lr_factor); saved with the loop state

    def _metrics_logger(self) -> MetricsLogger:
        run_name = f"{self.out_dir.absolute().parent.name}/{self.out_dir.absolute().name}"
        config = self.recipe_dict if self.recipe_dict is not None else {"train": dataclasses.asdict(self.cfg)}
        return MetricsLogger(self.out_dir, loggers=self.cfg.loggers, run_name=run_name, config=config)

    def _batch_to_device(self, batch):
        return tuple(t.to(self.device, non_blocking=True) for t in self.layout.shard_batch(batch))

    def _training_loss_fn(self) -> LossFn:
        """self.loss_fn, compiled when cfg.compile; recompiled if a stage swaps the objective."""
        if not self._compile_loss:
            return self.loss_fn
        source, compiled = self._compiled_loss
        if source is not self.loss_fn:
            # Under sequence-length warmup each window length gets its own static graph: dynamo's
            # automatic dynamic shapes would otherwise train the rest of the run, at full length,
            # on the symbolic-shape graph it builds at the second length.
            compiled = torch.compile(self.loss_fn, dynamic=False if self.cfg.seq_len_warmup_steps else None)
            self._compiled_loss = (self.loss_fn, compiled)
        return compiled

    # ---- one optimizer step ----------------------------------------------------------------------

    def train_step(self, micro_batches: list, group_norms: bool = False) -> dict:
        """Forward/backward over the micro-batches, then one optimizer step unless the guard flags
        the step (stats["event"]). group_norms: also return the gradient norm of each layer group."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg) * self.lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_ratio", 1.0)  # Muon's groups: their own peak (kiln.train.muon)
        # Each micro-batch's mean loss is weighted by its share of the step's tokens. The share is
        # computed against a nominal count (the first micro-batch's count times the number of
        # micro-batches: the only one known before the last backward) and corrected after, so
        # pretraining (every batch full) does no extra arithmetic at all.
        loss_fn = self._training_loss_fn()
        loss_sum = torch.zeros((), device=self.device)
        tokens = 0
        for i, batch in enumerate(micro_batches):
            # Gradients are reduced across data-parallel ranks once, in the last micro-batch's backward.
            with self.layout.gradient_sync(last_micro_batch=i == len(micro_batches) - 1):
                batch = self._batch_to_device(batch)
                with autocast(self.cfg.precision, self.device), self.layout.loss_context():
                    if self.layout.pipelined:  # the schedule runs forward and backward itself
                        loss, n_tokens = self.layout.pipeline_step(batch, train=True), batch[1].numel()
                        nominal = n_tokens * len(micro_batches)
                    else:
                        loss, n_tokens = loss_fn(self.forward_model, batch)
                        if i == 0:  # in the loss function's unit: tokens, or pairs, or sequences
                            nominal = max(int(n_tokens), 1) * len(micro_batches)
                        self.scaler.scale(loss * (n_tokens / nominal)).backward()
            loss_sum += _local(loss.detach()).float() * n_tokens
            tokens += int(n_tokens)
        loss_sum, tokens = self.layout.reduce_step_stats(loss_sum, tokens)
        params = [p for p in self.model.parameters() if p.grad is not None]
        self.scaler.unscale_(self.optimizer)
        # The data-parallel reduction averaged the ranks' gradients, so the nominal count of the step
        # is per rank x those ranks. A pipeline backpropagates each of its microbatches' mean loss
        # unweighted, pp_microbatches of them per micro-batch.
        correction = tokens / (nominal * self.layout.grad_average_ranks)
        if self.layout.pipelined:
            correction *= len(micro_batches) * self.layout.cfg.microbatches
        if correction != 1.0:
            torch._foreach_div_([p.grad for p in params], correction)
        stats = {"lr": lr, "tokens": tokens, "event": None}
        if group_norms:  # before clipping, like grad_norm
            stats["group_norms"] = group_grad_norms(self.model, self.grad_groups, self.layout, self.device)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = self.layout.clip_grad_norm(params, max_norm)
        loss = loss_sum / max(tokens, 1)
        if self.guard.enabled:
            # The decision must be taken before the optimizer step, so the loss and norm are read
            # now: one device sync per step (a single two-element copy), which costs the overlap of
            # this step's tail with the next step's launch. Both values are already global (the
            # loss reduced over ranks above, the norm by the clipping), so every rank decides alike.
            loss, grad_norm = torch.stack([loss.float(), grad_norm.float().to(loss.device)]).tolist()
            stats["event"] = self.guard.check(loss, grad_norm)
        if stats["event"] is None:
            self.scaler.step(self.optimizer)
        # Also after a flagged step: ends the scaler's unscale_/step cycle, and under fp16 backs the
        # scale off if the gradients overflowed.
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.layout.after_optimizer_step(self.step, final=self.step == cfg.max_steps)
        # Tokens the loop consumed, a flagged step's included: with the loader position they say
        # where in the data the run is.
        self.tokens_seen += tokens
        # Tensors unless the guard read them: reading forces a device sync, done only when logging.
        return {**stats, "loss": loss, "grad_norm": grad_norm}

    # ---- the loop --------------------------------------------------------------------------------

    def fit(self) -> dict:
        cfg = self.cfg
        self.watchdog = Watchdog(cfg.watchdog_s, self.out_dir, rank=self.rank, log_metrics=self.is_main)
        if self.metrics:
            prime_system_metrics()  # the first record's CPU and I/O figures then cover a real interval
        try:
            return self._fit()
        finally:
            self.watchdog.close()
            if isinstance(self.optimizer, NVMeAdamW):
                self.optimizer.close()  # its swap files; the checkpoints hold the state

    def accum_at(self, step: int) -> int:
        """Micro-batches of optimizer step `step` (0-based): during the batch ramp the global batch
        grows linearly, in whole micro-batches, from batch_ramp_start_tokens to global_batch_tokens.
        A pure function of the step, so a resumed run reads exactly the batches it would have."""
        ramp = self.cfg.batch_ramp_steps
        if step >= ramp:
            return self.accum_steps
        return self.ramp_start_accum + (self.accum_steps - self.ramp_start_accum) * step // ramp

    def _fit(self) -> dict:
        cfg = self.cfg
        start_wall = time.perf_counter()
        train_time, train_tokens = 0.0, 0
        window_time, window_tokens = 0.0, 0
        bar = tqdm(
            total=cfg.max_steps,
            initial=self.step,
            file=sys.stderr,
            disable=not self.is_main or progress_enabled() is False,
            desc=self.out_dir.name or "train",
            unit="step",
            dynamic_ncols=True,
        )
        batches = iter(self.train_loader)
        evaluated_at = None
        first_timeout = cfg.watchdog_s * FIRST_STEP_WATCHDOG_FACTOR
        if cfg.batch_ramp_steps and self.step == 0:
            self._event(
                "batch_ramp",
                start_tokens=self.accum_at(0) * self.tokens_per_micro_step,
                full_tokens=self.accum_steps * self.tokens_per_micro_step,
                ramp_steps=cfg.batch_ramp_steps,
            )
        while self.step < cfg.max_steps and not self.stopped_early:
            started = time.perf_counter()
            step = self.step + 1
            log_now = step % cfg.log_every == 0 or step == cfg.max_steps
            batch_tokens = self.accum_at(self.step) * self.tokens_per_micro_step
            with self.watchdog.watch(f"training step {step}", step, first_timeout):
                micro_batches = [next(batches) for _ in range(self.accum_at(self.step))]
                if cfg.seq_len_warmup_steps:  # pretraining batches only (check_applies refused the rest)
                    length = window_len_at(self.step, cfg)
                    micro_batches = [split_windows(b, length) for b in micro_batches]
                stats = self.train_step(micro_batches, group_norms=log_now)
            first_timeout = None
            last = self.step == cfg.max_steps
            if log_now:  # waits for the device
                loss, grad_norm = float(stats["loss"]), float(stats["grad_norm"])
            elapsed = time.perf_counter() - started
            window_time += elapsed
            window_tokens += stats["tokens"]
            train_time += elapsed
            train_tokens += stats["tokens"]
            bar.update(1)
            if log_now:
                tokens_per_s = window_tokens / window_time if window_time > 0 else 0.0
                mfu = model_flops_utilization(self.flops_per_token, tokens_per_s, self.peak_flops, self.world_size)
                record = {
                    "kind": "train",
                    "step": self.step,
                    "loss": loss,
                    "lr": stats["lr"],
                    "grad_norm": grad_norm,
                    "tokens_per_s": tokens_per_s,
                    "mfu": mfu,
                    "hfu": mfu * self.recompute_factor,
                    "peak_mem_mb": peak_memory_mb(self.device),
                    "tokens_seen": self.tokens_seen,
                    "batch_tokens": batch_tokens,
                }
                if cfg.seq_len_warmup_steps:
                    record["window_len"] = length
                record.update({f"grad_norm/{g}": v for g, v in zip(self.grad_groups, stats["group_norms"].tolist())})
                if self.metrics:
                    record.update(system_metrics(self.device))
                    self.metrics.log(record)
                bar.set_postfix(loss=f"{loss:.4f}", lr=f"{stats['lr']:.2e}")
                window_time, window_tokens = 0.0, 0
            if stats["event"] is not None:
                respond(self, stats["event"])
            if cfg.batch_ramp_steps and self.step == cfg.batch_ramp_steps:
                self._event("batch_ramp", batch_tokens=self.accum_steps * self.tokens_per_micro_step, done=True)
            improved = False
            if self.step % cfg.eval_every == 0 or last:
                with self.watchdog.watch(f"validation at step {self.step}", self.step):
                    improved = self._validate()
                evaluated_at = self.step
            if self.step % cfg.ckpt_every == 0 or last or self.stopped_early or (improved and cfg.keep_best):
                with self.watchdog.watch(f"saving the checkpoint of step {self.step}", self.step):
                    self.save_checkpoint(
                        is_best=improved, val_loss=self.last_val_loss if evaluated_at == self.step else None
                    )
        bar.close()
        with self.watchdog.watch(f"finishing the checkpoint of step {self.step}", self.step):
            self.ckpt.finish()
            if self.sharded_saver is not None:
                self.sharded_saver.finish()
        if self.after_fit is not None:
            self.after_fit(self)
        summary = self._summary(train_time, train_tokens, start_wall)
        if self.is_main:
            write_text_atomic(self.out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
            self.metrics.close()
        return summary

    # ---- guard responses and events ---------------------------------------------------------------

    def _event(self, type_: str, **details) -> None:
        """Log an event record (kiln report draws them as vertical lines) and print it."""
        if self.metrics:
            self.metrics.log({"kind": "event", "step": self.step, "type": type_, **details})
        if self.is_main:
            text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in details.items())
            tqdm.write(f"step {self.step} | {type_}: {text}", file=sys.stderr)
