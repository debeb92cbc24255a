"""kiln.cost: device-hours, energy and money of a finished stage, checked on worked numbers."""

from types import SimpleNamespace

import pytest

from kiln.cost import CPU_PRICE_PER_CORE_HOUR, CPU_WATTS_PER_CORE, DEFAULT_PUE, run_cost
from kiln.errors import ConfigError, DataError
from kiln.parallel.hardware import GPUS, ClusterConfig
from kiln.parallel.plan_time import (
    budget,
)


def gpu_summary(**extra) -> dict:
    # Two hours on 16 GPUs at 1.6M tokens/s (all ranks together), as Trainer.fit writes it.
    return {
        "steps": 1000,
        "tokens_seen": 11_520_000_000,
        "tokens_per_s": 1.6e6,
        "wall_s": 7200.0,
        "device": "cuda:0",
        "world_size": 16,
        "params": 1_000_000_000,
        **extra,
    }


def test_gpu_stage_on_worked_numbers():
    c = run_cost(gpu_summary(), "h100")
    assert (c["kind"], c["hardware"], c["world_size"]) == ("gpu", "H100 SXM 80GB", 16)
    # 7200 s x 16 GPUs = 32 GPU-hours; x 700 W TDP x PUE 1.2 = 26.88 kWh; x $2.50 = $80.
    assert c["device_hours"] == c["gpu_hours"] == pytest.approx(32.0)
    assert c["power_w"] == 700 and c["pue"] == DEFAULT_PUE == 1.2
    assert c["energy_kwh"] == pytest.approx(26.88)
    assert c["cost_usd"] == pytest.approx(80.0) and c["price_per_hour"] == 2.50
    assert c["usd_per_million_tokens"] == pytest.approx(80.0 / 11_520)
    assert c["core_hours"] is None and c["notes"] == []
    # Projection: 20 tokens per parameter = 2e10 tokens / 1.6e6 tokens/s = 12,500 s on 16 GPUs.
    [p] = c["projections"]
    assert p["label"] == "20 tokens per parameter" and p["tokens"] == 2e10
    assert p["days"] == pytest.approx(12_500 / 86_400)
    assert p["gpu_hours"] == pytest.approx(12_500 * 16 / 3600)
    assert p["energy_kwh"] == pytest.approx(12_500 * 16 / 3600 * 700 * 1.2 / 1000)
    assert p["cost_usd"] == pytest.approx(12_500 * 16 / 3600 * 2.5)


def test_overrides_price_power_and_pue():
    c = run_cost(gpu_summary(), "h100", 2.0, pue=1.5, power_w=500.0, token_budgets={"1T": 1e12})
    assert c["energy_kwh"] == pytest.approx(32 * 500 * 1.5 / 1000)  # 24 kWh
    assert c["cost_usd"] == pytest.approx(64.0)
    [p] = c["projections"]
    assert p["label"] == "1T" and p["gpu_hours"] == pytest.approx(1e12 / 1.6e6 * 16 / 3600)
    assert p["cost_usd"] == pytest.approx(p["gpu_hours"] * 2.0)
    assert run_cost(gpu_summary(), "a100")["cost_usd"] == pytest.approx(32 * 1.50)  # the table's price
    assert run_cost(gpu_summary(), "A100_80G")["hardware"] == "A100 SXM 80GB"  # the planner's aliases


def test_projection_agrees_with_the_planners_budget():
    """At the same throughput and world size, `kiln plan --tokens` and the report price alike
    (the planner counts GPU TDP only, which is PUE 1)."""
    tokens_per_s, tokens = 2.5e6, 3e12
    cluster = ClusterConfig(gpu="h200", gpus_per_node=8, n_nodes=2)
    planned = budget(SimpleNamespace(tokens_per_s=tokens_per_s), cluster, tokens)
    c = run_cost(gpu_summary(tokens_per_s=tokens_per_s), "h200", pue=1.0, token_budgets={"plan": tokens})
    [p] = c["projections"]
    assert p["gpu_hours"] == pytest.approx(planned["gpu_hours"])
    assert p["cost_usd"] == pytest.approx(planned["cost_usd"])
    assert p["energy_kwh"] == pytest.approx(planned["energy_mwh"] * 1000)
    assert p["days"] == pytest.approx(planned["days"])


def test_world_size_and_gpu_are_read_from_what_the_trainer_logs():
    # No world_size: the MFU identity mfu = flops_per_token * tokens_per_s / (peak * world) gives it.
    peak, fpt, tps = 989e12, 6e9, 1.6e6
    s = gpu_summary(world_size=None, flops_per_token=fpt, peak_flops=312e12, mfu=fpt * tps / (312e12 * 16))
    c = run_cost(s)
    assert (c["world_size"], c["world_size_from"]) == (16, "MFU identity")
    assert c["hardware"] == "A100 SXM 80GB" and c["energy_kwh"] == pytest.approx(32 * 400 * 1.2 / 1000)
    # The trainer's H100 and H200 peaks are the same number: a guess would be a coin toss.
    c = run_cost(gpu_summary(peak_flops=peak))
    assert c["hardware"] is None and c["energy_kwh"] is None and c["cost_usd"] is None
    assert any("h100 and h200" in n for n in c["notes"])
    assert run_cost(gpu_summary(peak_flops=peak), price_per_hour=3.0)["cost_usd"] == pytest.approx(96.0)
    assert run_cost(gpu_summary(device_name="NVIDIA H200"))["hardware"] == "H200 SXM 141GB"
    c = run_cost({"wall_s": 3600.0, "device": "cuda"}, "b200")
    assert (c["world_size"], c["world_size_from"], c["gpu_hours"]) == (1, "assumed", 1.0)
    assert c["projections"] == [] and any("1 device assumed" in n for n in c["notes"])


def test_cpu_stage_is_billed_per_core_hour():
    s = {
        "device": "cpu",
        "wall_s": 1800.0,
        "world_size": 2,
        "threads": 4,
        "tokens_seen": 3_000_000,
        "tokens_per_s": 2000.0,
        "params": 5_000_000,
    }
    c = run_cost(s)
    # 1800 s x 2 processes = 1 process-hour; x 4 threads = 4 core-hours.
    assert (c["kind"], c["gpu_hours"], c["device_hours"], c["core_hours"]) == ("cpu", 0.0, 1.0, 4.0)
    assert c["power_w"] == 4 * CPU_WATTS_PER_CORE == 20.0
    assert c["energy_kwh"] == pytest.approx(1.0 * 20 * 1.2 / 1000)
    assert c["cost_usd"] == pytest.approx(4 * CPU_PRICE_PER_CORE_HOUR) == pytest.approx(0.36)
    assert (c["price_per_hour"], c["price_unit"]) == (CPU_PRICE_PER_CORE_HOUR, "core-hour")
    [p] = c["projections"]  # 1e8 tokens / 2000 tokens/s = 50,000 s on 2 processes of 4 cores
    assert p["core_hours"] == pytest.approx(50_000 * 2 * 4 / 3600) and p["gpu_hours"] == 0.0
    assert run_cost(s, "cpu", 0.05)["cost_usd"] == pytest.approx(0.2)
    assert run_cost(s, cores=8)["core_hours"] == 8.0
    # Without a core count nothing is made up.
    c = run_cost({**s, "threads": None})
    assert c["core_hours"] is None and c["energy_kwh"] is None and c["cost_usd"] is None
    assert c["device_hours"] == 1.0 and any("pass the cores" in n for n in c["notes"])


def test_clear_errors():
    with pytest.raises(ConfigError, match="hardware: the stage trained on cpu"):
        run_cost({"device": "cpu", "wall_s": 1.0}, "h100")
    with pytest.raises(ConfigError, match="hardware: the stage trained on cuda"):
        run_cost(gpu_summary(), "cpu")
    with pytest.raises(ConfigError, match="hardware: unknown accelerator 'tpu'.*h100"):
        run_cost(gpu_summary(), "tpu")
    with pytest.raises(ConfigError, match="pue: must be a number >= 1"):
        run_cost(gpu_summary(), "h100", pue=0.9)
    with pytest.raises(ConfigError, match="price_per_hour"):
        run_cost(gpu_summary(), "h100", -1.0)
    with pytest.raises(ConfigError, match="cores"):
        run_cost({"device": "cpu", "wall_s": 1.0}, cores=0)
    with pytest.raises(ConfigError, match="tokens: the token budget 'x' must be a positive number"):
        run_cost(gpu_summary(), "h100", token_budgets={"x": 0})
    with pytest.raises(DataError, match="wall_s"):
        run_cost({"device": "cpu", "tokens_per_s": 10.0})
    assert sorted(GPUS) == ["a100", "b200", "h100", "h200", "mi300x"]  # the names the errors list


def test_resumed_stage_says_its_time_is_partial():
    c = run_cost(gpu_summary(resumed_from="runs/x/pretrain/checkpoints/step-00000500"), "h100")
    assert any("last invocation" in n for n in c["notes"])
