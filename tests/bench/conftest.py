"""The benchmarks import their siblings (machine, train_step) as top-level modules, as they do when
run as `python bench/X.py`: bench/ goes on sys.path for the tests that load them."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
