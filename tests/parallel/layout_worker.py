"""Run by torchrun in the layout tests: train a tiny model under a [parallel] layout.

argv: pack_dir out_dir json(spec) where spec = {"parallel": {...}, "model": {...}, "train": {...},
"resume": "auto"|"none", "kill_rank_after_step": [rank, step] (optional)}. Rank 0 writes the fit summary to out_dir/summary-<world>.json; the
per-step losses are in out_dir/metrics.jsonl as in any run.
"""

import json
import os
import signal
import sys

import torch.distributed as dist

from kiln.model import ModelConfig
from kiln.parallel.config import ParallelConfig
from kiln.parallel.dims import init_distributed
from kiln.train.config import TrainConfig
from kiln.train.trainer import Trainer

pack, out, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
init_distributed("cpu")
trainer = Trainer(
    ModelConfig(**spec["model"]),
    TrainConfig(**spec["train"]),
    pack,
    out,
    resume=spec.get("resume", "none"),
    parallel=ParallelConfig(**spec["parallel"]),
)
kill = spec.get("kill_rank_after_step")
if kill is not None and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    # Fault injection: one rank dies hard mid-run on the first attempt; torchrun restarts the job.
    step_once = trainer.train_step

    def train_step_then_die(*args, **kwargs):
        stats = step_once(*args, **kwargs)
        if dist.get_rank() == kill[0] and trainer.step == kill[1] + 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return stats

    trainer.train_step = train_step_then_die
summary = trainer.fit()
if dist.get_rank() == 0:
    with open(f"{out}/summary-{dist.get_world_size()}.json", "w") as f:
        json.dump(summary, f)
dist.destroy_process_group()
