"""Continual pretraining: replay of an earlier pack (train.replay), its validation split beside the
new one, and the schedule of an init_from run (docs/continual.md)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from kiln_testing.train import make_tiny_pack, tiny_train_config

from kiln.data.loader import TokenLoader
from kiln.data.replay import ReplayLoader
from kiln.errors import ConfigError, DataError
from kiln.model import ModelConfig
from kiln.model.weights import load_weights
from kiln.recipe import load_recipe
from kiln.train.config import ReplayConfig, TrainConfig
from kiln.train.schedule import lr_at
from kiln.train.trainer import Trainer

MODEL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """(old, new): two domains of one vocabulary, t -> 5t+3 and t -> 7t+2."""
    root = tmp_path_factory.mktemp("packs")
    return make_tiny_pack(root / "old"), make_tiny_pack(root / "new", rule=(7, 2))


@pytest.fixture(scope="module")
def old_run(packs, tmp_path_factory):
    """A model trained on the old pack only: the starting point of the continued runs."""
    out = tmp_path_factory.mktemp("old_run")
    summary = Trainer(MODEL, tiny_train_config(max_steps=30, eval_every=30, ckpt_every=30), packs[0], out).fit()
    return out, summary


def _stream(pack, n: int, seed: int = 0) -> list[np.ndarray]:
    """The first n train sequences of one pack on its own (one rank)."""
    loader = TokenLoader(pack, seq_len=16, batch_size=1, seed=seed)
    return [next(loader)[0][0].numpy() for _ in range(n)]


def _loader(pack, rank: int = 0, world_size: int = 1, seed: int = 0) -> TokenLoader:
    return TokenLoader(pack, seq_len=16, batch_size=4, rank=rank, world_size=world_size, seed=seed)


def test_replay_draws_its_share_from_the_old_pack_in_its_own_order(packs):
    old, new = packs
    loader = ReplayLoader(_loader(new), _loader(old), 0.25)
    rows = [row.numpy() for _ in range(10) for row in next(loader)[0]]
    expected_old, expected_new = iter(_stream(old, 10)), iter(_stream(new, 40))
    picks = []
    for g, row in enumerate(rows):
        from_old = math.floor((g + 1) * 0.25) > math.floor(g * 0.25)  # sequences 3, 7, 11, ...
        np.testing.assert_array_equal(row, next(expected_old if from_old else expected_new))
        picks.append(from_old)
    assert sum(picks) == 10 and loader.old.sequences == 10 and loader.new.sequences == 30
    # Two data-parallel ranks read the two halves of the same global batches.
    ranks = [ReplayLoader(_loader(new, r, 2), _loader(old, r, 2), 0.25) for r in (0, 1)]
    whole = ReplayLoader(TokenLoader(new, seq_len=16, batch_size=8), TokenLoader(old, seq_len=16, batch_size=8), 0.25)
    for _ in range(3):
        halves = torch.cat([next(r)[0] for r in ranks])
        assert torch.equal(halves, next(whole)[0])


def test_replay_state_resumes_the_same_stream(packs):
    old, new = packs
    first = ReplayLoader(_loader(new), _loader(old), 0.4)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))  # as the manifest stores it
    second = ReplayLoader(_loader(new), _loader(old), 0.4)
    second.load_state_dict(state)
    for _ in range(4):
        assert torch.equal(next(first)[0], next(second)[0])
    with pytest.raises(DataError, match="replay fraction 0.4"):
        ReplayLoader(_loader(new), _loader(old), 0.1).load_state_dict(state)
    with pytest.raises(DataError, match="with train.replay"):
        _loader(new).load_state_dict(state)
    with pytest.raises(DataError, match="without train.replay"):
        ReplayLoader(_loader(new), _loader(old), 0.4).load_state_dict(_loader(new).state_dict())


def test_replay_config_errors_name_the_key(packs, tmp_path):
    old, new = packs
    for fraction in (-0.1, 1.0):
        with pytest.raises(ConfigError, match=r"replay\.fraction: must be in \[0, 1\)"):
            TrainConfig(replay=ReplayConfig(pack=str(old), fraction=fraction)).validate()
    with pytest.raises(ConfigError, match=r"replay\.fraction: is 0.2 but pack is not set"):
        TrainConfig(replay=ReplayConfig(fraction=0.2)).validate()
    with pytest.raises(ConfigError, match=r"train\.replay\.pack: expected a string"):
        load_recipe(None, ["train.replay.pack=3"])
    assert load_recipe(None, [f"train.replay.pack={old}", "train.replay.fraction=0.25"]).train.replay == ReplayConfig(
        str(old), 0.25
    )

    def trainer(pack):
        cfg = tiny_train_config(replay=ReplayConfig(pack=str(pack), fraction=0.25))
        return Trainer(MODEL, cfg, new, tmp_path / "run")

    with pytest.raises(ConfigError, match=r"train\.replay\.pack: .*missing: no such folder"):
        trainer(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"train\.replay\.pack: .*no token shards"):
        trainer(tmp_path / "empty")
    other = make_tiny_pack(tmp_path / "other", tokenizer_sha256="another")
    with pytest.raises(ConfigError, match=r"train\.replay\.pack: .*tokenizer_sha256 'another' differs"):
        trainer(other)
    wider = make_tiny_pack(tmp_path / "wider", vocab=80)
    with pytest.raises(ConfigError, match=r"train\.replay\.pack: .*vocab_size 80 differs"):
        trainer(wider)
    batches = ([], [])
    with pytest.raises(ConfigError, match="this stage brings its own data"):
        Trainer(MODEL, tiny_train_config(replay=ReplayConfig(pack=str(old))), None, tmp_path / "own", data=batches)


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_continued_run_rewarms_and_reports_both_splits(packs, old_run, tmp_path, capsys):
    old, new = packs
    cfg = tiny_train_config(max_steps=8, eval_every=4, ckpt_every=8, replay=ReplayConfig(str(old), 0.25))
    out = tmp_path / "continued"
    summary = Trainer(MODEL, cfg, new, out, init_from=old_run[0]).fit()
    # init_from starts the new schedule at its step 0: warmup from lr / warmup_steps again, whatever
    # step and learning rate the earlier run ended on (Ibrahim et al. 2024's re-warming).
    train = _records(out, "train")
    assert [r["step"] for r in train] == list(range(1, 9))
    assert [r["lr"] for r in train] == pytest.approx([lr_at(s, cfg) for s in range(8)])
    assert train[0]["lr"] == pytest.approx(cfg.lr / cfg.warmup_steps)
    val = _records(out, "val")
    assert [r["step"] for r in val] == [4, 8]
    keys = ("val_loss", "val_bpb", "val_tokens", "val_sequences")
    assert all({k, f"{k}/replay"} <= set(r) for r in val for k in keys)
    # Checked against the old run's own evaluation of the same split: it is the old pack's val set.
    start = Trainer(MODEL, tiny_train_config(), old, tmp_path / "probe", init_from=old_run[0]).evaluate()
    assert start["val_loss"] == pytest.approx(old_run[1]["final_val_loss"], rel=1e-6)
    assert val[0]["val_tokens/replay"] == start["val_tokens"]
    assert val[0]["val_loss/replay"] != val[0]["val_loss"]
    assert summary["final_val_loss/replay"] == val[-1]["val_loss/replay"]
    assert summary["final_val_bpb/replay"] == val[-1]["val_bpb/replay"]
    assert summary["replay_fraction"] == 0.25 and summary["replay_sequences"] == 8 * 4 // 4
    assert "replay val loss" in capsys.readouterr().out
    # Fraction 0: the old split is still evaluated, nothing is replayed.
    cfg0 = tiny_train_config(
        max_steps=2, warmup_steps=1, eval_every=2, ckpt_every=2, replay=ReplayConfig(str(old), 0.0)
    )
    zero = Trainer(MODEL, cfg0, new, tmp_path / "zero", init_from=old_run[0]).fit()
    assert zero["replay_sequences"] == 0 and math.isfinite(zero["final_val_loss/replay"])


def test_resumed_replay_run_equals_uninterrupted(packs, old_run, tmp_path):
    old, new = packs
    cfg = tiny_train_config(max_steps=6, ckpt_every=3, eval_every=3, replay=ReplayConfig(str(old), 0.5))
    whole = tmp_path / "whole"
    Trainer(MODEL, cfg, new, whole, init_from=old_run[0]).fit()
    resumed = tmp_path / "resumed"
    summary = Trainer(MODEL, cfg, new, resumed, resume=str(whole / "checkpoints" / "step-00000003")).fit()
    assert summary["resumed_from"].endswith("step-00000003") and summary["replay_sequences"] == 12
    val = _records(whole, "val")[-1]
    assert (summary["final_val_loss"], summary["final_val_loss/replay"]) == (val["val_loss"], val["val_loss/replay"])
    after = [r["loss"] for r in _records(whole, "train") if r["step"] > 3]
    assert [r["loss"] for r in _records(resumed, "train")] == after
    _, a, _ = load_weights(whole)
    _, b, _ = load_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_replay_keeps_the_old_domain(packs, old_run, tmp_path):
    """Forgetting made visible: continuing on the new domain raises the old split's loss, less so
    with a quarter of every batch replayed (docs/continual.md has the numbers on real text)."""
    old, new = packs
    start = old_run[1]["final_val_loss"]
    ends = {}
    for fraction in (0.0, 0.25):
        cfg = tiny_train_config(max_steps=40, eval_every=40, ckpt_every=40, replay=ReplayConfig(str(old), fraction))
        ends[fraction] = Trainer(MODEL, cfg, new, tmp_path / f"f{fraction}", init_from=old_run[0]).fit()
    assert ends[0.0]["final_val_loss/replay"] > start + 1.0  # forgot
    assert ends[0.25]["final_val_loss/replay"] < ends[0.0]["final_val_loss/replay"] - 1.0
    assert ends[0.25]["final_val_loss"] < start  # and still learned the new domain
