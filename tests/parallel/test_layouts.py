"""Every parallel layout trains like one process: same per-step losses, same final weights.

Each case launches tests/parallel/layout_worker.py under torchrun with gloo on CPU (4 processes on
2 cores is slow but exact enough) and compares with a single-process fit of the same recipe. In
fp32 the only differences are the order of floating-point sums across ranks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.model import ModelConfig
from kiln.train.checkpoint import load_weights
from kiln.train.config import TrainConfig
from kiln.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("layout_worker.py")
MODEL = dict(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32, ffn_hidden=64)
TRAIN = dict(seq_len=16, micro_batch_size=2, global_batch_tokens=128, max_steps=4, lr=1e-2, warmup_steps=1,
             precision="fp32", log_every=1, eval_every=2, eval_batches=2, ckpt_every=2, peak_flops=1e12)
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
# Adam divides each gradient by its own running RMS, so an element whose gradient is ~1e-8 moves by
# up to lr whatever its sign noise: reduction-order differences show up as ~1e-5 weight changes.
# A real error (a missing or doubled reduction, a wrong shard) moves weights by ~lr = 1e-2.
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


def launch(pack, out, nproc: int, parallel: dict, model=None, train=None, resume="none", timeout=600):
    spec = {"parallel": parallel, "model": {**MODEL, **(model or {})}, "train": {**TRAIN, **(train or {})},
            "resume": resume}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(WORKER), str(pack), str(out), json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((Path(out) / f"summary-{nproc}.json").read_text())


def losses(out, key: str = "loss") -> list[float]:
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in records if r["kind"] == "train"]


def single_process(pack, out, dp: int = 1, model=None, train=None):
    """The reference: one process whose micro-batch is the dp ranks' micro-batches together."""
    train = {**TRAIN, **(train or {})}
    train["micro_batch_size"] *= dp
    Trainer(ModelConfig(**{**MODEL, **(model or {})}), TrainConfig(**train), pack, out, resume="none").fit()
    return losses(out), losses(out, "grad_norm"), load_weights(out / "checkpoints")[1]


@pytest.fixture(scope="module")
def reference(pack, tmp_path_factory):
    cache = {}

    def get(dp: int):
        if dp not in cache:
            cache[dp] = single_process(pack, tmp_path_factory.mktemp(f"single-dp{dp}"), dp)
        return cache[dp]
    return get


def assert_same_training(out, expected):
    ref_losses, ref_grad_norms, ref_weights = expected
    assert losses(out) == pytest.approx(ref_losses, rel=LOSS_RTOL)
    # Adam hides a wrongly scaled gradient; the clipped norm does not.
    assert losses(out, "grad_norm") == pytest.approx(ref_grad_norms, rel=GRAD_NORM_RTOL)
    weights = load_weights(Path(out) / "checkpoints")[1]
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=WEIGHT_ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


CASES = {
    # name: (processes, [parallel] table, data-parallel degree)
    "fsdp": (2, {"dp_shard": 2}, 2),
    "tp_sp": (2, {"tp": 2, "dp_shard": 1}, 1),
    "ddp": (2, {"dp_replicate": 2, "dp_shard": 1}, 2),
    "fsdp_zero2_offload": (2, {"dp_shard": 2, "reshard_after_forward": False, "offload": True}, 2),
    "hsdp": (4, {"dp_replicate": 2, "dp_shard": 2}, 4),
    "fsdp_tp": (4, {"dp_shard": 2, "tp": 2}, 2),
}
FAST = {"fsdp", "tp_sp"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_layout_matches_single_process(case, pack, reference, tmp_path):
    nproc, parallel, dp = CASES[case]
    launch(pack, tmp_path, nproc, parallel)
    assert_same_training(tmp_path, reference(dp))
