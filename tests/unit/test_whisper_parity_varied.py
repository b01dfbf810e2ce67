"""Whisper parity again, on a tiny checkpoint whose norm weights and biases are drawn at random too.

transformers initialises every LayerNorm to weight 1, bias 0 and every linear bias to 0, so on the default tiny
checkpoint an encoder or decoder that ignored a norm's weight, swapped two norms, or dropped a bias (q, v, out,
fc1, fc2, the convolutions) still matched. The same checks as tests/unit/test_whisper_parity.py (they are its
functions, run here with this module's fixtures) on `build_tiny_checkpoint(varied=True)`. The segment tests stay
on the default checkpoint: they need a decoder that emits timestamps, which this one's random norms do not promise.
"""

from __future__ import annotations

import pytest

# its tests, collected here, and its `reference` and `local` fixtures, both on this module's `checkpoint`
from tests.unit.test_whisper_parity import (  # noqa: F401
    local,
    reference,
    test_captured_decode_steps_equal_transformers,
    test_greedy_tokens_equal_transformers_generate,
    test_initial_prompt_and_language_detection,
    test_long_upload_windows_each_equal_transformers,
    test_the_encoder_buckets_give_the_encoders_output_and_transformers,
    test_window_scores_equal_transformers,
)
from tests.unit.test_whisper_parity import test_gpu_decoder_fused_ops_keep_the_tokens as fused_ops_keep_the_tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mstar_common.families.whisper.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("whisper") / "tiny-varied", varied=True)


def test_the_checkpoints_norms_and_biases_vary(reference):  # noqa: F811 - the fixture
    """(So the checks above see them: no LayerNorm of weight 1 and bias 0, no all-zero bias.)"""
    import torch

    model = reference[0]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    biases = [p for name, p in model.named_parameters() if name.endswith(".bias")]
    assert norms and biases
    assert all(not torch.all(n.weight == 1) and n.bias.any() for n in norms)
    assert all(b.any() for b in biases)


@pytest.mark.gpu
def test_gpu_decoder_fused_ops_keep_the_tokens_with_varied_norms(checkpoint):
    """The fused residual-add + LayerNorm kernel and the packed q/k/v GEMM on this checkpoint, whose norms and biases
    a kernel that dropped them would now get wrong."""
    fused_ops_keep_the_tokens(checkpoint)
