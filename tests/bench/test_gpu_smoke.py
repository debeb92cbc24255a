"""bench/gpu's prepared GPU checks, run on CPU in their --smoke mode: every case of memory_1b.py's
orchestration runs, its JSON has the planner's terms for the one-rank FSDP layout, and the model
states read off the tensors equal the planner's."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.model.config import AC_MODES
from kiln.parallel.plan import Layout, Workload, memory

GPU_BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
sys.path.insert(0, str(GPU_BENCH))
import memory_1b  # noqa: E402

SMOKE_SEQ, SMOKE_BATCHES = 64, (2, 1)


def test_memory_smoke_runs_every_case(tmp_path):
    out = memory_1b.main(["--smoke", "--json", str(tmp_path / "m.json")])
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads(json.dumps(out))
    names = [e["case"] for e in out["cases"]]
    assert names == [f"ac={ac} mb={mb}" for ac in AC_MODES for mb in SMOKE_BATCHES] + ["ac=none mb=2 fp8"]
    fp8_case = out["cases"][-1]
    if importlib.util.find_spec("torchao") is None:
        assert "torchao" in fp8_case["skipped"]
    else:  # torch._scaled_mm runs on the CPU: the trainer's conversion, as on the GPU
        assert "skipped" not in fp8_case, fp8_case
        assert fp8_case["result"]["fp8_linears"] > 0 and fp8_case["result"]["tokens_per_s_per_gpu"] > 0
    assert out["sdpa_probe"]["flash"] == "ok" and out["sdpa_probe"]["math"] == "ok"
    assert out["sdpa_probe"]["cudnn"].startswith("refused")
    for e in out["cases"][:-1]:
        assert "skipped" not in e, e
        assert e["planner_layout"] == f"dp=1 tp=1 pp=1 cp=1 zero=3 ac={e['ac']} mb={e['batch']}"
        want = memory(
            memory_1b.SMOKE_MODEL,
            Layout(zero=3, ac=e["ac"], micro_batch=e["batch"]),
            Workload(SMOKE_SEQ, e["batch"] * SMOKE_SEQ),
        )
        assert e["planner_bytes"] == {t: getattr(want, t) for t in memory_1b.PLANNER_TERMS} | {"total": want.total}
        assert all(v > 0 for v in e["planner_bytes"].values())
        # AdamW's fp32 m and v, fp32 weights and gradients: the planner's 16 bytes per parameter;
        # the optimizer's step counters (4 bytes per tensor) are all that the tensors hold beyond it.
        fp32_params = e["result"]["state_bytes"]["params"]
        assert e["states_planned"] == 16 * fp32_params / 4
        assert 1 <= e["states_ratio"] < 1.001
        assert e["peak_measured"] is None and e["peak_ratio"] is None  # CUDA only
        r = e["result"]
        assert r["ac"] == e["ac"] and r["batch"] == e["batch"] and r["seq"] == SMOKE_SEQ
        assert r["sdpa_backends"] == ["flash"]  # CPU's fused kernel, seen in the profiled step
        # No upper bound: on CPU the peak is one matmul timing, which another busy process can put
        # below the step's own rate (MFU > 1); only the GPU run's MFU is a measurement.
        assert r["tokens_per_s_per_gpu"] > 0 and 0 < r["mfu"] < math.inf
    acts = {e["ac"]: e["planner_bytes"]["activations"] for e in out["cases"] if e["batch"] == 2 and not e["fp8"]}
    # (With 2 layers, selective's kept tensors plus the one layer backward reruns exceed none's.)
    assert acts["none"] > acts["full"] and len(set(acts.values())) == 3


@pytest.mark.parametrize(
    ("flags", "reason"), [(["--budget-s", "0"], "budget: "), (["--capacity-gb", "0.001"], "planner predicts ")]
)
def test_memory_guards_skip_cases_and_say_why(flags, reason):
    out = memory_1b.main(["--smoke", "--fp8", "off", *flags])
    assert len(out["cases"]) == len(AC_MODES) * len(SMOKE_BATCHES)
    assert all(e["skipped"].startswith(reason) for e in out["cases"])


@pytest.mark.slow
def test_fsdp_smoke_compiles_and_trains(tmp_path):
    """fsdp_1b.py --smoke: compiled blocks under FSDP2, as on the GPU."""
    has_torchao = importlib.util.find_spec("torchao") is not None
    # --fp8 on/off, not auto: auto skips fp8 when the compiled bf16 run took half the time budget.
    fp8 = "on" if has_torchao else "off"
    subprocess.run(
        [sys.executable, str(GPU_BENCH / "fsdp_1b.py"), "--smoke", "--fp8", fp8, "--json", str(tmp_path / "f.json")],
        check=True,
        capture_output=True,
    )
    results = json.loads((tmp_path / "f.json").read_text())["results"]
    # The fp8 run follows the bf16 one wherever torchao imports (Kiln's conversion runs on the CPU too).
    assert [r["name"] for r in results][1:] == (["FSDP2 + compile + fp8 tensorwise (torchao)"] if has_torchao else [])
    for result in results:
        assert result["compile"] and result["sdpa_backends"] == ["flash"]
        assert result["state_bytes"]["grads"] == result["state_bytes"]["params"] > 0
