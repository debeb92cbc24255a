"""The watchdog: a hung step or checkpoint save ends the process with a diagnostic and exit code 3."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.recipe import load_recipe
from kiln.train.watchdog import WATCHDOG_EXIT_CODE, Watchdog

REPO = Path(__file__).resolve().parents[2]


def _blocked_in_a_recognisable_frame(event: threading.Event) -> None:
    event.wait(timeout=120)


def test_an_armed_watchdog_that_is_not_fed_fires_with_a_diagnostic(tmp_path):
    fired = threading.Event()
    texts = []

    def on_timeout(text):
        texts.append(text)
        fired.set()

    watchdog = Watchdog(0.2, tmp_path, on_timeout=on_timeout)
    watchdog.arm("training step 7", 7)
    _blocked_in_a_recognisable_frame(fired)  # returns once the watchdog fired
    watchdog.close()
    assert fired.is_set() and watchdog.fired
    text = texts[0]
    assert "step: 7" in text and "what: training step 7" in text and f"stage: {tmp_path.resolve()}" in text
    # Every thread's stack: the main thread is caught inside the function it was blocked in.
    assert "_blocked_in_a_recognisable_frame" in text and "kiln/train/watchdog.py" in text
    assert (tmp_path / "watchdog.txt").read_text() == text
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["kind"] == "event" and record["type"] == "watchdog" and record["step"] == 7
    assert record["what"] == "training step 7"


def test_a_watchdog_fed_regularly_never_fires(tmp_path):
    fired = []
    watchdog = Watchdog(2.0, tmp_path, on_timeout=fired.append)
    # Ten steps of 0.3 s: three seconds in all, longer than the timeout, but never one step.
    for step in range(10):
        with watchdog.watch(f"training step {step}", step):
            time.sleep(0.3)
    time.sleep(2.5)  # disarmed between steps and after: idle time does not count
    watchdog.close()
    assert fired == [] and not watchdog.fired
    assert not (tmp_path / "watchdog.txt").exists()


def test_disabled_watchdog_starts_no_thread(tmp_path):
    before = threading.active_count()
    watchdog = Watchdog(0, tmp_path)
    with watchdog.watch("training step 1", 1):
        assert threading.active_count() == before
    watchdog.close()
    assert not watchdog.enabled


# Trains in a fresh process whose loss function (or checkpoint save) hangs at a chosen step.
SCRIPT = textwrap.dedent("""
    import json, sys, time
    from kiln.model import ModelConfig
    from kiln.checkpoint import CheckpointManager
    from kiln.train.config import TrainConfig
    from kiln.train.trainer import Trainer, next_token_loss

    args = json.loads(sys.argv[1])

    def hang_forever():
        while True:
            time.sleep(0.05)

    trainer = None

    def loss_fn(model, batch):
        if args["hang"] == "step" and trainer.step + 1 == args["at"]:
            hang_forever()
        return next_token_loss(model, batch)

    save = CheckpointManager.save

    def hanging_save(self, step, *rest, **kwargs):
        if args["hang"] == "save" and step == args["at"]:
            hang_forever()
        return save(self, step, *rest, **kwargs)
    CheckpointManager.save = hanging_save

    trainer = Trainer(ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=16),
                      TrainConfig(seq_len=16, micro_batch_size=2, global_batch_tokens=32, max_steps=6, lr=1e-2,
                                  warmup_steps=1, precision="fp32", log_every=1, eval_every=100, eval_batches=1,
                                  ckpt_every=2, peak_flops=1e12, threads=1, watchdog_s=args["timeout"]),
                      args["pack"], args["out"], loss_fn=loss_fn)
    trainer.fit()
""")


@pytest.mark.parametrize(
    "hang, at, what", [("step", 3, "training step 3"), ("save", 4, "saving the checkpoint of step 4")]
)
def test_a_hung_training_process_exits_with_code_3(tmp_path, tiny_pack_factory, hang, at, what):
    pack = tiny_pack_factory(tmp_path / "pack")
    out = tmp_path / "run"
    # Generous next to a step of this model (milliseconds), so only the planted hang can fire it.
    args = {"pack": str(pack), "out": str(out), "hang": hang, "at": at, "timeout": 8.0}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == WATCHDOG_EXIT_CODE, proc.stderr[-3000:]
    diagnostic = (out / "watchdog.txt").read_text()
    assert f"step: {at}\n" in diagnostic and f"what: {what}\n" in diagnostic
    assert "in hang_forever" in diagnostic  # the stack shows where it hung
    assert diagnostic in proc.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "event" and records[-1]["type"] == "watchdog" and records[-1]["step"] == at
    assert max(r["step"] for r in records if r["kind"] == "train") == (2 if hang == "step" else 4)


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_watchdog_s_must_be_a_finite_non_negative_number(value):
    with pytest.raises(ConfigError) as err:
        load_recipe(None, [f"train.watchdog_s={value}"])
    assert err.value.key == "train.watchdog_s"
