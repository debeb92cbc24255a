import os

import pytest
import torch

# Tests compare numbers bit-for-bit in places; pin the thread count so results do not
# depend on how many cores the machine reports.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
