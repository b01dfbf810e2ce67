"""The captured step's inputs pulled from the host mirror and its tokens published to page-locked memory
(mstar_kernels/step_io.py), against the copies they replace; on the GPU with page-locked host tensors, as served."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED

triton = pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.step_io import BLOCK, publish_tokens, pull_inputs  # noqa: E402

PIN = not IS_INTERPRETED  # on the GPU the host side is page-locked memory the kernels read and write over the bus


@pytest.mark.parametrize("num_words", [1, 300, BLOCK, 3 * BLOCK + 17])
def test_the_pull_copies_the_prefix_of_the_mirror_the_parity_names(num_words):
    gen = torch.Generator().manual_seed(num_words)
    host = torch.randint(-2**31, 2**31 - 1, (2, 4 * BLOCK), generator=gen, dtype=torch.int32).pin_memory() if PIN \
        else torch.randint(-2**31, 2**31 - 1, (2, 4 * BLOCK), generator=gen, dtype=torch.int32)
    device = torch.full((4 * BLOCK,), 7, dtype=torch.int32, device=DEVICE)
    for parity_value in (1, 0):
        parity = torch.tensor([parity_value], dtype=torch.int32, device=DEVICE)
        pull_inputs(host, device, parity, num_words)
        assert torch.equal(device[:num_words].cpu(), host[parity_value, :num_words])
        assert (device[num_words:] == 7).all()  # past the prefix: untouched
        assert parity.item() == parity_value  # the pull reads the parity, the publish flips it


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_publish_writes_the_tokens_to_the_parity_s_array_and_flips_it(rows):
    host = torch.full((2, 64), -1, dtype=torch.int32)
    host = host.pin_memory() if PIN else host
    parity = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    first = torch.arange(rows, dtype=torch.int32, device=DEVICE) * 3
    publish_tokens(first, host, parity)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert host[0, :rows].tolist() == first.tolist() and (host[0, rows:] == -1).all() and (host[1] == -1).all()
    assert parity.item() == 1
    second = first + 1
    publish_tokens(second, host, parity)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert host[1, :rows].tolist() == second.tolist() and host[0, :rows].tolist() == first.tolist()
    assert parity.item() == 0
