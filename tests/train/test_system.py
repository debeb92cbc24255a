"""System metrics for the training log."""

import json
import math

import psutil
import pytest
import torch
from kiln_testing.train import tiny_train_config

from kiln.model.config import ModelConfig
from kiln.train import system
from kiln.train.system import prime_system_metrics, system_metrics
from kiln.train.trainer import Trainer

CPU_KEYS = {"sys/cpu_percent", "sys/proc_cpu_percent", "sys/ram_mb", "sys/rss_mb"}
IO_KEYS = {
    "sys/net_recv_bytes_per_s",
    "sys/net_sent_bytes_per_s",
    "sys/disk_read_bytes_per_s",
    "sys/disk_write_bytes_per_s",
}


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_metrics_have_the_documented_keys_and_sane_values(device):
    metrics = system_metrics(device)
    assert CPU_KEYS <= set(metrics) <= CPU_KEYS | IO_KEYS  # no GPU keys without a GPU
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    total_mb = psutil.virtual_memory().total / 2**20
    assert 0.0 <= metrics["sys/cpu_percent"] <= 100.0
    assert 0.0 <= metrics["sys/proc_cpu_percent"] <= 100.0 * psutil.cpu_count()
    assert 0.0 < metrics["sys/rss_mb"] < total_mb
    assert 0.0 < metrics["sys/ram_mb"] <= total_mb
    json.dumps(metrics)  # goes into metrics.jsonl as is


def test_rss_is_this_process_and_cpu_counts_work_done_since_the_last_call():
    system_metrics("cpu")
    before = system_metrics("cpu")["sys/rss_mb"]
    block = b"\x01" * (96 * 2**20)  # written, so its pages are resident
    after = system_metrics("cpu")
    assert after["sys/rss_mb"] - before >= 80
    del block
    sum(i * i for i in range(3_000_000))  # CPU work in this process between two calls
    assert system_metrics("cpu")["sys/proc_cpu_percent"] > 0.0


def test_io_rates_are_bytes_per_second_of_the_counters_since_the_previous_call(monkeypatch):
    """Rates from psutil's cumulative counters (stand-ins here, so the numbers are known): bytes
    moved since the previous call over the seconds between the calls; a counter going backwards
    (reset) gives 0, never a negative rate."""
    counters = iter(
        [
            {"net_recv": 1000.0, "net_sent": 0.0, "disk_read": 5000.0, "disk_write": 0.0},
            {"net_recv": 3000.0, "net_sent": 0.0, "disk_read": 4000.0, "disk_write": 8000.0},
        ]
    )
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(system, "_io_counters", lambda _psutil: next(counters))
    monkeypatch.setattr("time.monotonic", lambda: next(clock))
    prime_system_metrics()
    rates = {k: v for k, v in system_metrics("cpu").items() if k in IO_KEYS}
    assert rates == {
        "sys/net_recv_bytes_per_s": 1000.0,
        "sys/net_sent_bytes_per_s": 0.0,
        "sys/disk_read_bytes_per_s": 0.0,
        "sys/disk_write_bytes_per_s": 4000.0,
    }


def test_io_keys_come_from_the_machine_counters():
    if psutil.net_io_counters() is None or psutil.disk_io_counters() is None:
        pytest.skip("this platform has no network or disk counters")
    prime_system_metrics()
    metrics = system_metrics("cpu")
    assert IO_KEYS <= set(metrics)
    assert all(metrics[k] >= 0.0 and math.isfinite(metrics[k]) for k in IO_KEYS)


def test_first_record_after_start_up_has_a_real_cpu_interval(tmp_path, monkeypatch, tiny_pack_factory):
    """The Trainer primes the meter when it starts, so the first logged record's CPU figures
    cover the steps before it (training works the CPU, so they are above 0), not an empty interval."""
    monkeypatch.setattr(system, "_process", None)  # a fresh process: nothing primed yet
    pack = tiny_pack_factory(tmp_path / "pack")
    model = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, max_seq_len=32)
    # 40 steps (a few hundred ms): the machine-wide figure comes from /proc/stat's clock ticks (10 ms),
    # so an interval of a few milliseconds can read 0.0 however busy the CPU was.
    steps = 40
    Trainer(
        model,
        tiny_train_config(max_steps=steps, log_every=steps, eval_every=steps, ckpt_every=steps),
        pack,
        tmp_path / "out",
    ).fit()
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "sys/proc_cpu_percent" in r)
    assert first["sys/proc_cpu_percent"] > 0.0 and first["sys/cpu_percent"] > 0.0


def test_cuda_keys_come_from_torch_and_utilisation_is_optional(monkeypatch):
    # Stand-ins for the CUDA calls, so the GPU branch runs on a machine without a GPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 87)
    metrics = system_metrics("cuda")
    assert set(metrics) - IO_KEYS == CPU_KEYS | {"sys/gpu_util", "sys/gpu_mem_mb", "sys/gpu_mem_used_mb"}
    assert metrics["sys/gpu_util"] == 87.0
    assert metrics["sys/gpu_mem_mb"] == 3 * 1024 and metrics["sys/gpu_mem_used_mb"] == 20 * 1024

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    metrics = system_metrics(torch.device("cuda", 0))
    assert "sys/gpu_util" not in metrics and metrics["sys/gpu_mem_mb"] == 3 * 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_follows_a_real_allocation():
    before = system_metrics("cuda")["sys/gpu_mem_mb"]
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    metrics = system_metrics("cuda")
    assert metrics["sys/gpu_mem_mb"] - before >= 64
    assert metrics["sys/gpu_mem_used_mb"] >= metrics["sys/gpu_mem_mb"]
    if "sys/gpu_util" in metrics:
        assert 0.0 <= metrics["sys/gpu_util"] <= 100.0
    del block
