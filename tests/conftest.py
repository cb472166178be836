import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
