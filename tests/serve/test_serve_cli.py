"""`kiln serve`'s start-up (kiln/serve/cli.py): where the model is loaded."""

import argparse
import threading

import torch
from kiln_testing.serving import tiny_checkpoint

from kiln.infer.quant import PackedLinear
from kiln.serve import cli as serve_cli


def test_serve_loads_and_prepacks_the_model_off_the_calling_thread(tmp_path, monkeypatch):
    """The calling thread (the one that will run uvicorn) must run no parallel torch op, so that
    the scheduler thread's OpenMP pool is the process's only one (on_passing_thread says why)."""
    checkpoint = tiny_checkpoint(tmp_path, tmp_path / "ckpt")
    loaders, apps = [], []
    real = serve_cli.load_for_inference

    def recording_load(args):
        loaders.append(threading.current_thread())
        return real(args)

    monkeypatch.setattr(serve_cli, "load_for_inference", recording_load)
    monkeypatch.setattr("uvicorn.run", lambda app, **kwargs: apps.append(app))
    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers(dest="verb"))
    args = parser.parse_args(["serve", str(checkpoint), "--device", "cpu", "--dtype", "float32", "--prepack"])
    assert serve_cli.run_serve(args) == 0
    assert len(loaders) == 1 and loaders[0] is not threading.current_thread()
    packed = [m for m in apps[0].state.serve.model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.dtype == torch.float32 for m in packed)
