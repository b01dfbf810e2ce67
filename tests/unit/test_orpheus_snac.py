"""The SNAC component against the `snac` package's decoder, on the same random 24 kHz weights.

Tolerance: max |diff| <= 1e-5 on the float waveform (tanh output in [-1, 1]); measured 0.0 on this CPU.
Windows follow the chunk policy stated in families/orpheus/codes.py; the reference pipeline below rebuilds
it from the `snac` package alone.
"""

import json

import numpy as np
import pytest
import torch

from mstar_common.checkpoints import vary_norms_and_biases
from mstar_common.families.orpheus.codec import SnacCodec, window_codes
from mstar_common.families.orpheus.codes import SpeechChunker
from mstar_common.families.orpheus.snac import SNAC_24KHZ, ResidualUnit, Snake1d, load_snac_decoder
from mstar_common.families.orpheus.tokens import CODEBOOK_SIZE, TokenLayout

snac = pytest.importorskip("snac")
ATOL = 1e-5
SAMPLES_PER_FRAME = 2048


def _save(tmp_path, config, seed, old_naming=False):
    torch.manual_seed(seed)
    model = vary_norms_and_biases(snac.SNAC(**config).eval())  # Snake alphas not all 1, conv biases not all 0
    state = model.state_dict()
    if old_naming:  # the published checkpoint's `weight_g`/`weight_v` (torch.nn.utils.weight_norm) names
        state = {k.replace(".parametrizations.weight.original0", ".weight_g")
                  .replace(".parametrizations.weight.original1", ".weight_v"): v for k, v in state.items()}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(state, tmp_path / "pytorch_model.bin")
    return model


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The real 24 kHz architecture (19.8M parameters), noise off."""
    path = tmp_path_factory.mktemp("snac24")
    reference = _save(path, {**SNAC_24KHZ, "noise": False}, seed=0, old_naming=True)
    return reference, SnacCodec(load_snac_decoder(path), torch.device("cpu"), max_batch=8)


def _reference_window(reference, window: np.ndarray) -> np.ndarray:
    """The reference's convert_to_audio on one 28-token window: decode, keep samples 2048:4096."""
    frame = window.reshape(-1)
    codes = [torch.tensor([[frame[7 * j] for j in range(4)]]),
             torch.tensor([[frame[7 * j + k] for j in range(4) for k in (1, 4)]]),
             torch.tensor([[frame[7 * j + k] for j in range(4) for k in (2, 3, 5, 6)]])]
    with torch.inference_mode():
        return reference.decode(codes)[0, 0, 2048:4096].numpy()


def test_the_checkpoints_snake_alphas_and_biases_vary(full):
    """As SNAC initialises them, every Snake alpha is 1 and every conv bias 0: a decoder that ignored or swapped the
    alphas (x + sin(x)^2) matched the reference exactly. (So the checks below see them.)"""
    reference, _ = full
    alphas = [m.alpha for m in reference.decoder.modules() if hasattr(m, "alpha")]
    biases = [p for name, p in reference.decoder.named_parameters() if name.endswith(".bias")]
    assert len(alphas) > 20 and biases
    assert all(not torch.all(a == 1) for a in alphas) and all(b.any() for b in biases)


def test_decoder_equals_snac_decode(full):
    reference, codec = full
    codes = [torch.randint(0, CODEBOOK_SIZE, (2, 4 * s)) for s in (1, 2, 4)]
    with torch.inference_mode():
        want, got = reference.decode(codes), codec.decoder(codes)
    assert got.shape == want.shape == (2, 1, 4 * 4 * 512)
    assert (got - want).abs().max().item() <= ATOL


def test_each_window_equals_the_reference_window(full):
    reference, codec = full
    windows = np.random.default_rng(1).integers(0, CODEBOOK_SIZE, size=(2, 4, 7)).astype(np.int32)
    got = codec.decode(windows)
    assert got.shape == (2, SAMPLES_PER_FRAME) and got.dtype == np.float32
    for row in range(2):
        np.testing.assert_allclose(got[row], _reference_window(reference, windows[row]), atol=ATOL, rtol=0)


def test_a_whole_stream_equals_the_reference_pipeline(full):
    """Tokens of 4 frames through the chunker and the batched codec == per-frame reference decodes (both edges)."""
    reference, codec = full
    layout = TokenLayout(custom_start=100, vocab_size=100 + 10 + 7 * CODEBOOK_SIZE, bos=1, eot=2)
    frames = np.random.default_rng(2).integers(0, CODEBOOK_SIZE, size=(4, 7))
    tokens = [layout.audio_start + pos * CODEBOOK_SIZE + int(c) for f in frames for pos, c in enumerate(f)]
    chunker = SpeechChunker(layout)
    audio = np.concatenate([codec.decode(w) for w in (chunker.push(tokens[:22]), chunker.push(tokens[22:]),
                                                        chunker.close()) if len(w)])
    expected = []
    for f in range(4):  # window [f-1, f, f+1, f+2], edges repeating the nearest frame
        idx = [min(max(i, 0), 3) for i in range(f - 1, f + 3)]
        expected.append(_reference_window(reference, frames[idx]))
    np.testing.assert_allclose(audio.reshape(-1), np.concatenate(expected), atol=ATOL, rtol=0)


def test_noise_blocks_match_under_the_same_seed(tmp_path):
    config = {**SNAC_24KHZ, "decoder_dim": 64, "encoder_dim": 8}  # noise=True as the published checkpoint
    reference = _save(tmp_path, config, seed=3)
    ours = load_snac_decoder(tmp_path)
    codes = [torch.randint(0, CODEBOOK_SIZE, (2, 4 * s)) for s in (1, 2, 4)]
    with torch.inference_mode():
        torch.manual_seed(9)
        want = reference.decode(codes)
        torch.manual_seed(9)
        got = ours(codes)
    assert (got - want).abs().max().item() <= ATOL
    quiet = load_snac_decoder(tmp_path, noise=False)  # the override silences the NoiseBlocks
    with torch.inference_mode():
        torch.manual_seed(1)
        first = quiet(codes)
        torch.manual_seed(2)
        assert torch.equal(quiet(codes), first)


def test_window_codes_split_frames_like_the_reference():
    window = torch.arange(28).reshape(1, 4, 7)
    level0, level1, level2 = window_codes(window)
    assert level0.tolist() == [[0, 7, 14, 21]]
    assert level1.tolist() == [[1, 4, 8, 11, 15, 18, 22, 25]]
    assert level2[0, :4].tolist() == [2, 3, 5, 6]


def test_bad_windows_are_refused(full):
    _, codec = full
    with pytest.raises(ValueError, match=r"\[N, 4, 7\]"):
        codec.check(np.zeros((2, 3, 7), np.int32))
    with pytest.raises(ValueError, match="4096"):
        codec.check(np.full((1, 4, 7), 4096, np.int32))


def test_a_non_24khz_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**SNAC_24KHZ, "attn_window_size": 32}))
    with pytest.raises(ValueError, match="24 kHz"):
        load_snac_decoder(tmp_path)


@pytest.mark.gpu
def test_cuda_graph_buckets_equal_eager(full):
    reference, _ = full
    cpu = full[1]
    codec = SnacCodec(cpu.decoder.to("cuda"), torch.device("cuda"), max_batch=16, use_cuda_graphs=True)
    windows = np.random.default_rng(4).integers(0, CODEBOOK_SIZE, size=(11, 4, 7)).astype(np.int32)
    with torch.inference_mode():
        eager = codec.played_frames(torch.from_numpy(windows).cuda()).cpu().numpy()
    served = codec.decode(windows)
    np.testing.assert_allclose(served, eager, atol=1e-4, rtol=0)
    assert sorted(codec.graphs) == [1, 2, 4, 8, 16]
    # The GPU path (fused Snake kernel, cropped stages, graphs) against the package's CPU decode-and-cut.
    # 1e-3: PyTorch runs fp32 convolutions as TF32 on CUDA by default (measured 3e-4 on the H200, ~10 LSB
    # of 16-bit PCM); the CPU path above holds 1e-5.
    assert all(m.use_kernel for m in codec.decoder.modules() if isinstance(m, Snake1d))
    for row in (0, 10):
        np.testing.assert_allclose(served[row], _reference_window(reference, windows[row]), atol=1e-3, rtol=0)


def test_decode_range_equals_the_full_decode_cut(full):
    """The receptive-field crop is exact wherever the range sits, edges included (float reassociation only)."""
    _, codec = full
    codes = [torch.randint(0, CODEBOOK_SIZE, (2, 4 * s), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 4)]
    with torch.inference_mode():
        whole = codec.decoder(codes)
        for start, stop in [(0, 2048), (2048, 4096), (6144, 8192), (0, 8192), (100, 101), (4000, 4100)]:
            part = codec.decoder.decode_range(codes, start, stop)
            assert part.shape == (2, 1, stop - start)
            assert (part - whole[..., start:stop]).abs().max().item() <= ATOL
        with pytest.raises(ValueError, match="outside"):
            codec.decoder.decode_range(codes, 8000, 8200)


@pytest.mark.gpu
def test_cudnn_depthwise_convs_give_the_same_frames(full, monkeypatch):
    """With MSTAR_SNAC_CUDNN_DEPTHWISE=1 an fp32 codec on CUDA runs the residual units' depthwise convs through
    cuDNN: the same frames as PyTorch's own depthwise kernel, to TF32's rounding."""
    decoder = full[1].decoder.to("cuda")
    windows = torch.from_numpy(np.random.default_rng(5).integers(0, CODEBOOK_SIZE, size=(6, 4, 7)).astype(np.int32))
    monkeypatch.setenv("MSTAR_SNAC_CUDNN_DEPTHWISE", "1")
    codec = SnacCodec(decoder, torch.device("cuda"), max_batch=8)
    assert all(m.use_cudnn_depthwise for m in decoder.modules() if isinstance(m, ResidualUnit))
    with torch.inference_mode():
        via_cudnn = codec.played_frames(windows.cuda()).cpu()
        decoder.use_fused_kernels(cudnn_depthwise=False)
        native = codec.played_frames(windows.cuda()).cpu()
        decoder.use_fused_kernels()
    assert (via_cudnn - native).abs().max().item() <= 1e-3


def test_a_bfloat16_codec_is_as_close_to_snac_as_snac_in_bfloat16(tmp_path):
    """`model_kwargs.codec_dtype: bfloat16` (docs/orpheus.md) had no test: the decoder in bf16 against the reference
    in fp32 is off by no more than twice the reference's own bf16 error (measured: 0.0073 against 0.0085, on a
    waveform of RMS 0.44)."""
    import copy

    reference = _save(tmp_path, {**SNAC_24KHZ, "noise": False}, seed=0, old_naming=True)
    codes = [torch.randint(0, CODEBOOK_SIZE, (2, 4 * s), generator=torch.Generator().manual_seed(s)) for s in (1, 2, 4)]
    decoder = load_snac_decoder(tmp_path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in decoder.parameters()} == {torch.bfloat16}
    with torch.inference_mode():
        want = reference.decode(codes)
        rounding = (copy.deepcopy(reference).to(torch.bfloat16).decode(codes).float() - want).abs().max()
        got = decoder(codes).float()
    assert got.shape == want.shape and (got - want).abs().max() <= 2 * rounding


def test_a_codec_file_that_is_not_a_checkpoint_is_refused_naming_it(tmp_path):
    """The published codec ships pytorch_model.bin, which the pre-start header checks (safetensors only) passed: a
    Git LFS pointer there failed at the codec's load with torch's UnpicklingError, naming no file and advising to
    turn the safe loader off. `mstar check` now refuses it, and so does the load."""
    import copy

    import yaml

    from mstar_common.checkpoints import resolve_checkpoint
    from mstar_common.cli import CONFIGS
    from mstar_common.config import DeploymentError, deployment_from_dict
    from mstar_common.families.orpheus.snac import check_codec_readable
    from mstar_common.families.registry import get_family

    config = {**SNAC_24KHZ, "decoder_dim": 64, "encoder_dim": 8}
    _save(tmp_path, config, seed=3)
    check_codec_readable(tmp_path)
    (tmp_path / "pytorch_model.bin").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:00\n")
    rule = rf"{tmp_path / 'pytorch_model.bin'} is not a readable PyTorch checkpoint .*Git LFS pointer"
    with pytest.raises(ValueError, match=rule):
        load_snac_decoder(tmp_path)
    raw = yaml.safe_load((CONFIGS / "orpheus.yaml").read_text())
    raw.setdefault("model_kwargs", {})["codec_checkpoint"] = str(tmp_path)
    family = get_family("orpheus")
    checkpoint = resolve_checkpoint(raw["checkpoint"], family.builtin_checkpoints)
    with pytest.raises(DeploymentError, match=rf"^t.yaml: model_kwargs.codec_checkpoint: {rule}"):
        family.check_checkpoint(deployment_from_dict(copy.deepcopy(raw)), checkpoint, "t.yaml")
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04 cut short")  # a zip's start, then nothing
    with pytest.raises(ValueError, match=rf"{tmp_path / 'pytorch_model.bin'} is not a readable PyTorch checkpoint"):
        load_snac_decoder(tmp_path)
