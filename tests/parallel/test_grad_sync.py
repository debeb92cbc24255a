"""FSDP2 gradient sync under accumulation (`[parallel] grad_sync`): per micro-batch and deferred train
like one process, and differ in how many reduce-scatters they issue.

With the layout tests' recipe each of the 2 ranks runs 2 micro-batches per step (8 sequences of 16
tokens, micro-batches of 2). Run as a script (by torchrun), this file runs the layout tests' worker with
FSDP2's reduce-scatter calls counted, and rank 0 writes the count next to the fit summary.
"""

import json
import os
import sys
from pathlib import Path

import pytest

MICRO_BATCHES = 2  # per rank per step: 128 tokens / 16 / 2 ranks / micro-batch 2
STEPS = 4


def _count_reduce_scatters_around_layout_worker() -> None:
    """Run tests/parallel/layout_worker.py (argv: pack out spec) counting FSDP2's reduce-scatters."""
    import runpy

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    calls = [0]
    reduce_scatter = _fsdp_collectives.DefaultReduceScatter.__call__

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return reduce_scatter(self, *args, **kwargs)

    _fsdp_collectives.DefaultReduceScatter.__call__ = counted
    worker = runpy.run_path(str(Path(__file__).with_name("layout_worker.py")), run_name="__main__")
    if os.environ["RANK"] == "0":
        fsdp = sum(1 for m in worker["trainer"].forward_model.modules() if hasattr(m, "set_requires_gradient_sync"))
        Path(sys.argv[2], "sync.json").write_text(json.dumps({"reduce_scatters": calls[0], "fsdp_modules": fsdp}))


if __name__ == "__main__":
    _count_reduce_scatters_around_layout_worker()
    sys.exit(0)

import importlib.util  # noqa: E402

# The layout tests' recipe, single-process reference and comparison, shared rather than restated.
_spec = importlib.util.spec_from_file_location("layout_cases", Path(__file__).with_name("test_layouts.py"))
_layouts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layouts)
MODEL, TRAIN = _layouts.MODEL, _layouts.TRAIN
assert_same_training, single_process = _layouts.assert_same_training, _layouts.single_process
_layouts.WORKER = Path(__file__)  # this copy of the module launches the counting worker above


@pytest.fixture(scope="module")
def pack(tmp_path_factory, tiny_pack_factory):
    return tiny_pack_factory(tmp_path_factory.mktemp("pack"))


@pytest.fixture(scope="module")
def reference(pack, tmp_path_factory):
    return single_process(pack, tmp_path_factory.mktemp("single"), dp=2)


def _launch(pack, out, parallel: dict) -> dict:
    _layouts.launch(pack, out, 2, parallel)
    return json.loads((Path(out) / "sync.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("grad_sync", ["per_microbatch", "deferred"])
def test_fsdp_grad_sync_trains_like_one_process(pack, reference, tmp_path, grad_sync):
    sync = _launch(pack, tmp_path, {"dp_shard": 2, "grad_sync": grad_sync})
    assert_same_training(tmp_path, reference)
    # One reduce-scatter per FSDP module (each block and the root) per reducing backward.
    reducing_backwards = STEPS * (MICRO_BATCHES if grad_sync == "per_microbatch" else 1)
    assert sync["fsdp_modules"] == MODEL["n_layers"] + 1
    assert sync["reduce_scatters"] == sync["fsdp_modules"] * reducing_backwards


@pytest.mark.parametrize(
    "parallel, reason",
    [
        ({"dp_shard": 1}, "needs dp_shard \\* cp > 1; one process has no reduce-scatter"),
        ({"dp_replicate": 2, "dp_shard": 1}, "the layout dp_replicate=2 has no reduce-scatter"),
        ({"dp_shard": 2, "pp": 2}, "is decided by the pipeline schedule under pp > 1"),
    ],
)
def test_deferred_sync_is_refused_where_fsdp_does_not_reduce_scatter(parallel, reason):
    from kiln.errors import ConfigError
    from kiln.parallel.config import ParallelConfig

    with pytest.raises(ConfigError, match=f"grad_sync: .*{reason}"):
        ParallelConfig(**parallel, grad_sync="deferred").validate()
    ParallelConfig(**parallel).validate()  # the default is accepted everywhere


def test_grad_sync_must_be_a_known_mode():
    from kiln.errors import ConfigError
    from kiln.parallel.config import ParallelConfig

    with pytest.raises(ConfigError, match="grad_sync: must be one of per_microbatch, deferred, got 'never'"):
        ParallelConfig(dp_shard=2, grad_sync="never").validate()
