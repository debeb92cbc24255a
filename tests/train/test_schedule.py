import math

import pytest

from kiln.errors import ConfigError
from kiln.train.config import TrainConfig
from kiln.train.schedule import lr_at


def test_cosine_exact_values():
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, max_steps=14, schedule="cosine")
    # warmup: (step + 1) / 4
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # after warmup, progress = (step + 1 - 4) / 10; lr = 0.1 + 0.45 * (1 + cos(pi * progress))
    assert lr_at(4, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.1)), abs=1e-15)
    assert lr_at(8, cfg) == pytest.approx(0.55, abs=1e-15)  # half way: cos(pi/2) = 0
    assert lr_at(13, cfg) == pytest.approx(0.1, abs=1e-15)  # last step lands on the floor
    assert lr_at(100, cfg) == pytest.approx(0.1, abs=1e-15)  # past the end: stays at the floor
    values = [lr_at(s, cfg) for s in range(3, 14)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_wsd_exact_values():
    cfg = TrainConfig(lr=2.0, min_lr_ratio=0.0, warmup_steps=2, max_steps=20, schedule="wsd", decay_fraction=0.2)
    assert [lr_at(s, cfg) for s in range(2)] == [1.0, 2.0]
    # stable until step 15 (the last 4 steps decay): 1 - sqrt((step + 1 - 16) / 4)
    assert all(lr_at(s, cfg) == 2.0 for s in range(2, 16))
    assert lr_at(16, cfg) == pytest.approx(2.0 * (1 - math.sqrt(0.25)), abs=1e-15)  # 1.0
    assert lr_at(17, cfg) == pytest.approx(2.0 * (1 - math.sqrt(0.5)), abs=1e-15)
    assert lr_at(18, cfg) == pytest.approx(2.0 * (1 - math.sqrt(0.75)), abs=1e-15)
    assert lr_at(19, cfg) == 0.0


def test_wsd_floor_and_constant():
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.5, warmup_steps=0, max_steps=10, schedule="wsd", decay_fraction=0.5)
    assert lr_at(0, cfg) == 1.0 and lr_at(4, cfg) == 1.0
    assert lr_at(9, cfg) == 0.5
    constant = TrainConfig(lr=3e-4, warmup_steps=2, max_steps=10, schedule="constant")
    assert [lr_at(s, constant) for s in (0, 1, 2, 9)] == [1.5e-4, 3e-4, 3e-4, 3e-4]


def test_no_warmup_starts_at_peak_region():
    cfg = TrainConfig(lr=1.0, min_lr_ratio=0.0, warmup_steps=0, max_steps=2, schedule="cosine")
    assert lr_at(0, cfg) == pytest.approx(0.5, abs=1e-15)
    assert lr_at(1, cfg) == pytest.approx(0.0, abs=1e-15)


def test_unknown_schedule_names_key():
    cfg = TrainConfig(schedule="linear")
    with pytest.raises(ConfigError, match="schedule"):
        lr_at(100, cfg)
