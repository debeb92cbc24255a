"""bench/context_extension.py's overrides: --set reaches the base and the extension, --extend-set only
the extension (whose train settings the control reuses)."""

from pathlib import Path

from context_extension import parse_args, recipes

MUON = ["train.optimizer=muon", "train.muon_adjust_lr=match_rms_adamw"]
ADAMW = ["train.optimizer=adamw", "train.muon_adjust_lr=original"]


def test_set_reaches_both_runs_and_extend_set_only_the_extension(tmp_path: Path):
    base, extended = recipes(parse_args(["--set", *MUON, "train.seed=7", "--extend-set", *ADAMW]), tmp_path)
    assert (base.train.optimizer, base.train.seed) == ("muon", 7)
    assert (extended.train.optimizer, extended.train.muon_adjust_lr, extended.train.seed) == ("adamw", "original", 7)
    assert (base.train.seq_len, extended.train.seq_len) == (32, 128)


def test_without_overrides_both_runs_use_adamw(tmp_path: Path):
    base, extended = recipes(parse_args([]), tmp_path)  # SMALL pins AdamW over tiny's Muon
    assert base.train.optimizer == extended.train.optimizer == "adamw"
    both = recipes(parse_args(["--set", *MUON]), tmp_path)
    assert [r.train.optimizer for r in both] == ["muon", "muon"]
