"""Validation and the run's summary: evaluating the validation split, the best-loss and early-
stopping state, the line an evaluation prints, and what fit() returns. A mixin of
kiln.train.trainer.Trainer, whose __init__ sets every attribute these methods read."""

from __future__ import annotations

import math
import sys
import time

import torch
from tqdm import tqdm

from kiln.data.replay import ReplayLoader
from kiln.errors import ConfigError
from kiln.model import count_params
from kiln.storage import join
from kiln.train.metrics import model_flops_utilization, peak_memory_mb
from kiln.train.precision import autocast


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor; its local value is the loss."""
    return t.to_local() if hasattr(t, "to_local") else t


class Validation:
    # ---- validation ------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, loader=None) -> dict:
        """val_loss (mean loss per token), val_bpb (bits per byte), and what they cover: val_tokens
        (tokens the loss counted) and val_sequences (windows, or a stage's examples). The set is
        the whole validation split of `loader` (default: the run's), or with eval_batches > 0 a
        fixed sample of that many global batches spread over it (the sources' validation_batches)."""
        loader = loader if loader is not None else self.val_loader
        self.model.eval()
        total, tokens, sequences = 0.0, 0, 0
        # A pipeline splits each batch into its microbatches: the smaller last batch must too.
        row_multiple = self.layout.cfg.microbatches if self.layout.pipelined else 1
        for batch in loader.validation_batches(self.cfg.eval_batches, row_multiple):
            sequences += batch[0].shape[0]
            batch = self._batch_to_device(batch)
            with autocast(self.cfg.precision, self.device), self.layout.loss_context():
                if self.layout.pipelined:
                    loss, n_tokens = self.layout.pipeline_step(batch, train=False), batch[1].numel()
                else:
                    loss, n_tokens = self.eval_loss_fn(self.model, batch)
            total += _local(loss).double().item() * n_tokens
            tokens += int(n_tokens)
        self.model.train()
        total, tokens = self.layout.reduce_loss_stats(torch.tensor(total, dtype=torch.float64), tokens)
        # The tokens slot is summed over the data- and context-parallel ranks only; the context-
        # parallel ranks of a replica read the same sequences, each a slice of them.
        _, sequences = self.layout.reduce_loss_stats(torch.zeros((), dtype=torch.float64), sequences)
        # A source that is not split over the data-parallel ranks (world_size 1: a post stage's
        # held-out examples) is evaluated whole on each of them: count it once.
        replicas = self.layout.dp_size // getattr(loader, "world_size", 1)
        if tokens == 0:
            raise ConfigError(
                "eval_batches",
                f"the validation split of {getattr(loader, 'pack_dir', self.pack_dir)} yielded no batches",
            )
        val_loss = total.item() / tokens
        # Bits per byte divides out the tokenizer: loss in nats per token -> bits per token -> per byte.
        # Sources that count no text bytes (conversations, preference pairs, BERT's masked
        # tokens) have none: None, which metrics.jsonl and summary.json write as
        # null (NaN is not JSON, and strict parsers refuse it).
        bytes_per_token = getattr(loader, "bytes_per_token", None)
        val_bpb = val_loss / math.log(2) / bytes_per_token if bytes_per_token else None
        return {
            "val_loss": val_loss,
            "val_bpb": val_bpb,
            "val_tokens": tokens // replicas,
            "val_sequences": sequences // (replicas * self.layout.dims.cp),
        }

    def _validate(self) -> bool:
        """Evaluate, log, print, update best/early-stopping state; True if the loss improved."""
        result = self.evaluate()
        if self.replay_val_loader is not None:
            self.last_replay_val = {f"{k}/replay": v for k, v in self.evaluate(self.replay_val_loader).items()}
            result.update(self.last_replay_val)
        val_loss, val_bpb = result["val_loss"], result["val_bpb"]
        self.last_val_loss, self.last_val_bpb = val_loss, val_bpb
        self.last_val_tokens, self.last_val_sequences = result["val_tokens"], result["val_sequences"]
        improved = val_loss < self.best_val_loss
        if improved:
            self.best_val_loss, self.best_val_bpb, self.best_step = val_loss, val_bpb, self.step
            self.evals_since_best = 0
        else:
            self.evals_since_best += 1
            if self.cfg.early_stop_patience and self.evals_since_best >= self.cfg.early_stop_patience:
                self.stopped_early = True
        if self.metrics:
            self.metrics.log({"kind": "val", "step": self.step, **result, "tokens_seen": self.tokens_seen})
        if self.is_main:
            tqdm.write(validation_line(self.step, result, self.stopped_early), file=sys.stdout)
        return improved

    # ---- the summary -----------------------------------------------------------------------------

    def _summary(self, train_time: float, train_tokens: int, start_wall: float) -> dict:
        """What fit() returns and writes to summary.json."""
        tokens_per_s = train_tokens / train_time if train_time > 0 else 0.0
        mfu = model_flops_utilization(self.flops_per_token, tokens_per_s, self.peak_flops, self.world_size)
        return {
            "steps": self.step,
            "tokens_seen": self.tokens_seen,
            "stopped_early": self.stopped_early,
            "final_val_loss": self.last_val_loss,
            "final_val_bpb": self.last_val_bpb,
            "val_tokens": self.last_val_tokens,
            "val_sequences": self.last_val_sequences,
            **self._replay_summary(),
            "best_val_loss": self.best_val_loss if self.best_step >= 0 else None,
            "best_val_bpb": self.best_val_bpb if self.best_step >= 0 else None,
            "best_step": self.best_step,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "hfu": mfu * self.recompute_factor,
            "peak_flops": self.peak_flops,
            "flops_per_token": self.flops_per_token,
            "peak_mem_mb": peak_memory_mb(self.device),
            "params": count_params(self.model_cfg),
            "non_embedding_params": count_params(self.model_cfg, non_embedding=True),
            "accum_steps": self.accum_steps,
            "pipeline_bubble": self.layout.bubble_fraction(),
            "precision": self.cfg.precision,
            "optimizer_impl": self.cfg.optimizer_impl if self.cfg.optimizer == "adamw" else None,
            "fp8_linears": self.fp8_linears,
            "device": str(self.device),
            "guard_events": self.guard.events,
            "lr_scale": self.lr_scale,
            "resumed_from": self.resumed_from,
            # What kiln.cost bills: devices x the time spent training.
            "world_size": self.world_size,
            "train_s": train_time,
            "threads": torch.get_num_threads() if self.device.type == "cpu" else None,
            "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
            "wall_s": time.perf_counter() - start_wall,
            "checkpoint": str(join(self.ckpt.root, self.ckpt.latest_name)) if self.ckpt.latest_name else None,
        }

    def _replay_summary(self) -> dict:
        """The replay pack's split at the last evaluation (final_val_loss/replay, ...) and the share
        of training sequences drawn from it; nothing without train.replay.pack."""
        if self.replay_val_loader is None:
            return {}
        last = self.last_replay_val or {}
        out = {f"final_{k}" if k.startswith(("val_loss", "val_bpb")) else k: v for k, v in last.items()}
        out["replay_fraction"] = self.cfg.replay.fraction
        out["replay_sequences"] = self.train_loader.old.sequences if isinstance(self.train_loader, ReplayLoader) else 0
        return out


def validation_line(step: int, result: dict, stopped_early: bool = False) -> str:
    """The line an evaluation prints. Bits per byte only where it is defined: post-training sources
    (conversations, preference pairs) count no text bytes, so their val_bpb is None and left out."""
    bpb = result["val_bpb"]
    return (
        f"step {step} | val loss {result['val_loss']:.4f}"
        + ("" if bpb is None else f" | val bpb {bpb:.4f}")
        + f" | on {result['val_tokens']} tokens, {result['val_sequences']} sequences"
        + (f" | replay val loss {result['val_loss/replay']:.4f}" if "val_loss/replay" in result else "")
        + (" | early stop" if stopped_early else "")
    )
