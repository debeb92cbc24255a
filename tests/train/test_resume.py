"""A run SIGKILLed after step k and resumed must reproduce the uninterrupted run bit for bit."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kiln.checkpoint import complete_checkpoints
from kiln.model.weights import load_weights

REPO = Path(__file__).resolve().parents[2]

# Runs training in a fresh process. With kill_at set, the process SIGKILLs itself when the
# checkpoint of that step is about to be written, after leaving a half-written temporary folder,
# as a crash in the middle of saving would.
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys
    from kiln.model import ModelConfig
    from kiln.checkpoint import CheckpointManager
    from kiln.train.config import TrainConfig
    from kiln.train.trainer import Trainer

    args = json.loads(sys.argv[1])
    if args["kill_at"]:
        original_save = CheckpointManager.save

        def save(self, step, *rest, **kwargs):
            if step == args["kill_at"]:
                partial = self.root / f".tmp-step-{step:08d}"
                partial.mkdir()
                (partial / "model.safetensors").write_bytes(b"partial")
                os.kill(os.getpid(), signal.SIGKILL)
            return original_save(self, step, *rest, **kwargs)
        CheckpointManager.save = save
    Trainer(ModelConfig(**args["model"]), TrainConfig(**args["train"]), args["pack"], args["out"]).fit()
""")


def _launch(
    pack: Path,
    out: Path,
    precision: str,
    kill_at: int = 0,
    compile: bool = False,
    offload: str = "none",
    impl: str = "foreach",
) -> subprocess.Popen:
    args = {
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 16},
        # Accumulation (2 micro-batches) and warmup+cosine so that every piece of state matters.
        "train": {
            "seq_len": 16,
            "micro_batch_size": 2,
            "global_batch_tokens": 64,
            "max_steps": 12,
            "warmup_steps": 3,
            "lr": 1e-2,
            "precision": precision,
            "log_every": 1,
            "eval_every": 3,
            "eval_batches": 2,
            "ckpt_every": 4,
            "keep_last": 2,
            "peak_flops": 1e12,
            "threads": 1,
            "compile": compile,
            "optimizer_offload": offload,
            "optimizer_impl": impl,
        },
        "pack": str(pack),
        "out": str(out),
        "kill_at": kill_at,
    }
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, json.dumps(args)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> int:
    _, err = proc.communicate(timeout=300)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"training subprocess failed:\n{err}")
    return proc.returncode


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "precision, compile, offload, impl",
    [
        ("fp32", False, "none", "foreach"),
        ("bf16", False, "none", "foreach"),
        # The fused AdamW kernel is compared with itself: both runs use it (it is not bit-equal to foreach).
        pytest.param("bf16", False, "none", "fused", marks=pytest.mark.slow),
        # torch.compile (of the loss function with the model inside) must not break exactness either.
        pytest.param("bf16", True, "none", "foreach", marks=pytest.mark.slow),
        # AdamW's moments in swap files: the killed run's swap folder is stale, the checkpoint holds
        # the state, and the uninterrupted run it is compared with keeps its state in memory.
        pytest.param("fp32", False, "nvme", "foreach", marks=pytest.mark.slow),
    ],
)
def test_killed_and_resumed_run_equals_uninterrupted(tmp_path, precision, compile, offload, impl, tiny_pack_factory):
    pack = tiny_pack_factory(tmp_path / "pack")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    # The two first runs are independent: run them side by side.
    procs = [
        _launch(pack, straight, precision, compile=compile, impl=impl),
        _launch(pack, crashed, precision, kill_at=8, compile=compile, offload=offload, impl=impl),
    ]
    assert [_finish(p) for p in procs] == [0, -signal.SIGKILL]

    root = crashed / "checkpoints"
    # Step 4 from ckpt_every, step 6 because its validation loss was the best so far (keep_best);
    # step 3 (also a best) was pruned by keep_last=2.
    assert [p.name for p in complete_checkpoints(root)] == ["step-00000004", "step-00000006"]
    assert (root / ".tmp-step-00000008").is_dir()
    killed_log = _log(crashed)
    assert max(r["step"] for r in killed_log) == 8  # it trained past the checkpoint it resumes from
    assert not (crashed / "summary.json").exists()

    stale = sorted((crashed / "optimizer_offload").glob("kiln-optim-*"))
    assert len(stale) == (offload == "nvme")
    assert _finish(_launch(pack, crashed, precision, compile=compile, offload=offload, impl=impl)) == 0
    if offload == "nvme":  # the resumed run removed its own swap folder, and only that
        assert sorted((crashed / "optimizer_offload").iterdir()) == stale
    summary = json.loads((crashed / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step-00000006")
    assert summary["optimizer_impl"] == impl
    assert not (root / ".tmp-step-00000008").exists()

    expected, got = _log(straight), _log(crashed)
    # The resumed log replaces what the killed run logged after step 6, so the whole log matches.
    assert [(r["kind"], r["step"]) for r in got] == [(r["kind"], r["step"]) for r in expected]
    for key in ("loss", "grad_norm", "lr", "tokens_seen", "val_loss", "val_bpb"):
        differ = [
            (r["kind"], r["step"], r.get(key), e.get(key)) for r, e in zip(got, expected) if r.get(key) != e.get(key)
        ]
        assert not differ, f"{key} differs (kind, step, resumed, uninterrupted): {differ}"
    assert len([r for r in got if r["kind"] == "train" and r["step"] > 6]) == 6

    _, final_expected, manifest_expected = load_weights(straight)
    _, final_got, manifest_got = load_weights(crashed)
    assert manifest_got["step"] == manifest_expected["step"] == 12
    for name, tensor in final_expected.items():
        assert torch.equal(final_got[name], tensor), name
    assert manifest_got["loader"] == manifest_expected["loader"]
    assert json.loads((straight / "summary.json").read_text())["final_val_loss"] == summary["final_val_loss"]
