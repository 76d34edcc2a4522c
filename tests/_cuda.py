"""The marks of a test module that needs a CUDA device (and runs in the cuda session of its own)."""

from __future__ import annotations

import pytest
import torch

CUDA_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device, and a session of its own: NOTEBOOK_ACCEL_TEST_CUDA=1 python -m pytest -m cuda",
    ),
]
