"""The checkpoint side of the training loop: finding the checkpoint a run resumes, restoring the
loop from it, init_from's weights, and saving. A mixin of kiln.train.trainer.Trainer, whose
__init__ sets every attribute these methods read."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from kiln.checkpoint import (
    WEIGHTS_LAYOUT,
    capture_rng_state,
    complete_checkpoints,
    load_sharded,
    read_manifest,
    resolve_checkpoint,
    restore_rng_state,
    step_dirname,
)
from kiln.errors import ConfigError
from kiln.model.weights import model_config_from_dict
from kiln.peft.load import load_into
from kiln.storage import is_remote
from kiln.train.metrics import truncate_metrics
from kiln.train.schedule import lr_at


class Checkpointing:
    # ---- resume and init_from --------------------------------------------------------------------

    def _find_checkpoint(self, resume: str):
        """(folder, manifest, full model state or None if sharded, train state) or None."""
        root = self.ckpt.root
        if resume == "none":
            if complete_checkpoints(root):
                raise ConfigError(
                    "resume",
                    f"{root} holds checkpoints of an earlier run; "
                    f"use resume=auto to continue it, or remove that folder",
                )
            found = None
        elif resume == "auto":
            found = self.ckpt.load_newest_valid(quarantine=self.is_main)
        else:
            # A step folder of this run's remote root loads by its URL, so that resume rewinds the root;
            # a root resolves to `latest`: resume continues the newest.
            if is_remote(resume) and self.ckpt.holds(resume):
                folder = resume.rstrip("/")
            else:
                folder = resolve_checkpoint(resume, pointer="latest")
            found = (folder, *self.ckpt.load(folder))
        if found is None:
            if self.is_main:
                self._set_metrics_aside()
            return None
        folder, manifest = found[:2]
        layout = manifest.get("weights_layout", 1)
        if layout < WEIGHTS_LAYOUT:
            # Its weights convert (upgrade_layout), its optimizer state does not: layout 3 split
            # SwiGLU's w13 into w1 and w3, so the moments no longer line up with the parameters.
            raise ConfigError(
                "resume",
                f"{folder} was written with weights layout {layout} (before SwiGLU's gate and up became "
                f"w1 and w3); its optimizer state cannot continue in this Kiln. Its weights still load: "
                f"start a new run with --init-from {folder}",
            )
        saved_cfg = manifest["model_config"]
        current = dataclasses.asdict(self.model_cfg)
        changed = [f"{k}: {saved_cfg.get(k)!r} -> {v!r}" for k, v in current.items() if saved_cfg.get(k) != v]
        if changed:
            raise ConfigError("model", f"differs from the checkpoint {folder} being resumed ({'; '.join(changed)})")
        return found

    def _set_metrics_aside(self) -> None:
        """A run starting from step 0 logs afresh; the log an earlier attempt left (one whose
        checkpoints were all damaged, or that died before its first save) is kept beside it."""
        path = self.out_dir / "metrics.jsonl"
        if not path.is_file() or path.stat().st_size == 0:
            path.unlink(missing_ok=True)
            return
        n = 1
        while (kept := path.with_name(f"metrics.previous-{n}.jsonl")).exists():
            n += 1
        path.rename(kept)
        print(f"starting from step 0; the earlier {path.name} is kept as {kept.name}")

    def _resume(self, found, init_from) -> str:
        folder, manifest, model_state, train_state = found
        if init_from is not None:
            warnings.warn(f"resuming from {folder}; init_from={init_from} is ignored", stacklevel=3)
        if model_state is None:
            load_sharded(folder, self.model, self.optimizer)
        else:
            self.layout.load_full_optimizer_state(self.model, self.optimizer, train_state["optimizer"])
        if train_state["scaler"]:
            self.scaler.load_state_dict(train_state["scaler"])
        if self.layout.diloco is not None:
            self._resume_diloco(train_state, manifest["step"])
        loop = dict(train_state["loop"])
        self.guard.load_state_dict(loop.pop("guard", {}))
        for key, value in loop.items():
            setattr(self, key, value)
        self.train_loader.load_state_dict(manifest["loader"])
        restore_rng_state(manifest["rng"])
        if self.is_main:
            truncate_metrics(self.out_dir / "metrics.jsonl", self.step)
            if self.ckpt.holds(folder):
                self.ckpt.rewind(self.step, self.best_step)
        return str(folder)

    def _resume_diloco(self, train_state: dict, step: int) -> None:
        if "diloco" not in train_state:
            raise ConfigError("parallel.outer", "diloco cannot resume a checkpoint written without it")
        self.layout.diloco.load_state_dict(train_state["diloco"])
        if not self.is_main:
            path = self._replica_file(step)
            if not path.is_file():
                raise ConfigError("resume", f"{path}: this replica's DiLoCo state is missing")
            replica = torch.load(path, map_location=self.device, weights_only=True)
            self.model.load_state_dict(replica["model"])
            self.optimizer.load_state_dict(replica["optimizer"])

    def _init_from(self, path) -> None:
        try:
            load_into(self.model, path)  # LoRA folded in, adapters attached: any folder a stage leaves
        except RuntimeError as e:
            init_cfg = model_config_from_dict(read_manifest(resolve_checkpoint(path))["model_config"], str(path))
            first = str(e).strip().splitlines()
            raise ConfigError(
                "init_from",
                f"{path}: weights do not fit the model "
                f"({first[1].strip() if len(first) > 1 else first[0]}); "
                f"checkpoint model is {init_cfg}",
            ) from None

    # ---- checkpoints -----------------------------------------------------------------------------

    def _replica_file(self, step: int) -> Path:
        """Under DiLoCo each replica's weights (mid-round) and inner optimizer state are its own:
        ranks other than 0 keep theirs here, rank 0's are the checkpoint's."""
        return self.out_dir / "diloco-replicas" / f"step-{step:08d}-rank-{self.rank}.pt"

    def _save_replica(self) -> None:
        path = self._replica_file(self.step)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")  # a rank killed mid-write leaves no half file
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}, partial)
        partial.replace(path)
        for old in path.parent.glob(f"step-*-rank-{self.rank}.pt"):  # those of pruned checkpoints
            step = int(old.name.split("-")[1])
            if step < self.step and not (self.ckpt.root / step_dirname(step)).is_dir():
                old.unlink()

    def save_checkpoint(self, is_best: bool = False, val_loss: float | None = None) -> None:
        if self.layout.diloco is not None and not self.is_main:
            self._save_replica()
            return
        if not self.is_main and self.sharded_saver is None:
            return
        loop = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "best_val_loss": self.best_val_loss,
            "best_val_bpb": self.best_val_bpb,
            "best_step": self.best_step,
            "evals_since_best": self.evals_since_best,
            "last_val_loss": self.last_val_loss,
            "last_val_bpb": self.last_val_bpb,
            "last_val_tokens": self.last_val_tokens,
            "last_val_sequences": self.last_val_sequences,
            "last_replay_val": self.last_replay_val,
            "stopped_early": self.stopped_early,
            "lr_scale": self.lr_scale,
            "guard": self.guard.state_dict(),
        }
        train_state = {"scaler": self.scaler.state_dict(), "loop": loop}
        if self.layout.diloco is not None:  # the anchor and the outer momentum, common to the replicas
            train_state["diloco"] = self.layout.diloco.state_dict()
        manifest_extra = {
            "tokens_seen": self.tokens_seen,
            "val_loss": val_loss,
            "train_config": dataclasses.asdict(self.cfg),
            "recipe": self.recipe_dict,
            "loader": self.train_loader.state_dict(),
            "rng": capture_rng_state(),
            # The schedule is a pure function of the step (kiln.train.schedule), so the
            # step is the whole scheduler state.
            "schedule": {
                "step": self.step,
                "lr_scale": self.lr_scale,
                "lr": lr_at(max(self.step - 1, 0), self.cfg) * self.lr_scale,
            },
        }
        if self.sharded_saver is not None:  # every rank writes its shards
            self.sharded_saver.save(
                self.step, self.model_cfg, self.model, self.optimizer, train_state, manifest_extra, is_best=is_best
            )
            return
        train_state["optimizer"] = self.optimizer.state_dict()
        self.ckpt.save(self.step, self.model_cfg, self.model.state_dict(), train_state, manifest_extra, is_best=is_best)
