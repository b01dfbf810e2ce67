"""mstar_kernels/gather_tokens.py: the previous step's tokens into the input ids, for a device-held count."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.gather_tokens import gather_tokens  # noqa: E402


@pytest.mark.parametrize("count", [0, 1, 5, 8])
def test_gather_fills_exactly_count_rows(count):
    ids = torch.arange(100, 120, dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([3, 0, 19, 7, 8, 9, 10, 11], dtype=torch.int32, device=DEVICE)
    src = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7], dtype=torch.int32, device=DEVICE)
    previous = torch.tensor([900, 901, 902, 903, 904, 905, 906, 907], dtype=torch.int32, device=DEVICE)
    expected = ids.clone().cpu()
    expected[dst[:count].long().cpu()] = previous[src[:count].long()].cpu()
    gather_tokens(ids, dst, src, torch.tensor([count], dtype=torch.int32, device=DEVICE), previous)
    assert torch.equal(ids.cpu(), expected)
