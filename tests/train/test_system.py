"""System metrics for the training log."""

import json
import math

import psutil
import pytest
import torch

from kiln.train.system import system_metrics

CPU_KEYS = {"sys/cpu_percent", "sys/proc_cpu_percent", "sys/ram_mb", "sys/rss_mb"}


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_metrics_have_the_documented_keys_and_sane_values(device):
    metrics = system_metrics(device)
    assert set(metrics) == CPU_KEYS  # no GPU keys without a GPU
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


def test_cuda_keys_come_from_torch_and_utilisation_is_optional(monkeypatch):
    # Stand-ins for the CUDA calls, so the GPU branch runs on a machine without a GPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "utilization", lambda device: 87)
    metrics = system_metrics("cuda")
    assert set(metrics) == CPU_KEYS | {"sys/gpu_util", "sys/gpu_mem_mb", "sys/gpu_mem_used_mb"}
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
