"""Every RNG a training process uses, captured as JSON for the checkpoint manifest (byte states as
base64) and restored on resume."""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def capture_rng_state() -> dict:
    """Every RNG the process uses, JSON-serialisable (byte states as base64)."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]]
        )
