"""Run by torchrun in the layout tests: train a tiny model under a [parallel] layout.

argv: pack_dir out_dir json(spec) where spec = {"parallel": {...}, "model": {...}, "train": {...},
"resume": "auto"|"none"}. Rank 0 writes the fit summary to out_dir/summary-<world>.json; the
per-step losses are in out_dir/metrics.jsonl as in any run.
"""

import json
import sys

import torch.distributed as dist

from kiln.model import ModelConfig
from kiln.parallel.config import ParallelConfig
from kiln.parallel.dims import init_distributed
from kiln.train.config import TrainConfig
from kiln.train.trainer import Trainer

pack, out, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
init_distributed("cpu")
trainer = Trainer(ModelConfig(**spec["model"]), TrainConfig(**spec["train"]), pack, out,
                  resume=spec.get("resume", "none"), parallel=ParallelConfig(**spec["parallel"]))
summary = trainer.fit()
if dist.get_rank() == 0:
    with open(f"{out}/summary-{dist.get_world_size()}.json", "w") as f:
        json.dump(summary, f)
dist.destroy_process_group()
