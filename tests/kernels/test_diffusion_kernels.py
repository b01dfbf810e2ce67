"""The diffusion kernels (mstar_kernels/dit.py, mstar_kernels/group_norm.py, silu_mul into a slice) against their eager
torch compositions, and a whole FLUX.2 transformer and VAE decoder with the kernels against the same modules without."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.conftest import DEVICE, GPU_ONLY, IS_INTERPRETED, rel_err, sweep

pytest.importorskip("triton")
pytestmark = GPU_ONLY

from mstar_kernels.dit import (  # noqa: E402
    ada_layer_norm,
    ada_layer_norm_ref,
    gated_residual,
    gated_residual_ref,
    gated_rms_residual,
    gated_rms_residual_modulate,
    gated_rms_residual_modulate_ref,
    gated_rms_residual_ref,
    qk_norm_rope,
    qk_norm_rope_ref,
    rms_modulate,
    rms_modulate_ref,
    rope_tables_from_complex,
)
from mstar_kernels.group_norm import group_norm, group_norm_ref  # noqa: E402
from mstar_kernels.silu_mul import silu_mul, silu_mul_pair, silu_mul_pair_ref, silu_mul_ref  # noqa: E402

TOL = 3e-2 if IS_INTERPRETED else 1e-2  # the interpreter truncates to bf16, compounding over roundings
DTYPES = [torch.bfloat16, torch.float32]
BITWISE = not IS_INTERPRETED  # fp32 results may differ in the last bit: the GPU compiler fuses a*b+c into an FMA


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 convolutions and matmuls in fp32, not TF32, so fp32 comparisons can be tight."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def _no_less_accurate(out: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor) -> None:
    """The kernel's result is as close to the fp64 result as the eager ops' (within 25%, plus rounding)."""
    err, eager_err = rel_err(out, exact), rel_err(eager, exact)
    floor = 3e-2 if IS_INTERPRETED and out.dtype == torch.bfloat16 else (4e-3 if out.dtype == torch.bfloat16 else 1e-6)
    assert err <= 1.25 * eager_err + floor, (err, eager_err)


def _fused_transformer_no_less_accurate(model, x, context, t, rope) -> None:
    """A whole DiT `model(x, context, t, rope)` with its fused kernels against its eager ops: close to them, no
    further from the fp64 forward than they are, and the switch back off gives the eager result again."""
    with torch.inference_mode():
        ref = model(x, context, t, rope)
        model.use_fused_kernels(True)
        out = model(x, context, t, rope)
        model.use_fused_kernels(False)
        assert torch.equal(model(x, context, t, rope), ref)  # switched back off
        exact = model.double()(x.double(), context.double(), t, rope)
    assert rel_err(out, ref) < 5 * TOL
    _no_less_accurate(out, ref, exact)


def _randn(*shape, dtype, gen, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=gen) * scale + offset).to(dtype).to(DEVICE)


def _mods(batch, dim, sets, dtype, gen):
    """`sets` (shift, scale, gate) triples as views of one `[B, 1, 3·sets·D]` tensor, as the blocks chunk them."""
    mod = _randn(batch, 3 * sets * dim, dtype=dtype, gen=gen, scale=0.5).unsqueeze(1)
    return torch.chunk(mod, 3 * sets, dim=-1)


@pytest.mark.parametrize("batch,seq,dim", sweep([(1, 300, 3072), (3, 17, 1000)], [(2, 5, 96), (1, 3, 40)]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_ada_layer_norm_with_and_without_the_gated_residual(batch, seq, dim, dtype):
    gen = torch.Generator().manual_seed(seq + dim)
    x = _randn(batch, seq, dim, dtype=dtype, gen=gen, scale=3.0, offset=0.5)
    shift, scale, gate = _mods(batch, dim, 1, dtype, gen)
    out, ref = ada_layer_norm(x, shift, scale, 1e-6), ada_layer_norm_ref(x, shift, scale, 1e-6)
    assert rel_err(out, ref) < TOL
    if dtype == torch.bfloat16 and not IS_INTERPRETED:
        assert (out != ref).float().mean() < 0.01  # the same roundings; only the mean/variance sums differ
    # strided rows (a slice of the joint sequence, as the output norm reads it)
    wide = _randn(batch, seq + 4, dim, dtype=dtype, gen=gen)[:, 4:]
    assert rel_err(ada_layer_norm(wide, shift, scale, 1e-6), ada_layer_norm_ref(wide, shift, scale, 1e-6)) < TOL
    y = _randn(batch, seq, dim, dtype=dtype, gen=gen)
    (res, out), (res_ref, ref) = (ada_layer_norm(x, shift, scale, 1e-6, gate=gate, y=y),
                                  ada_layer_norm_ref(x, shift, scale, 1e-6, gate=gate, y=y))
    assert not BITWISE or dtype != torch.bfloat16 or torch.equal(res, res_ref)  # rounded exactly like eager
    assert rel_err(res, res_ref) < TOL and rel_err(out, ref) < TOL


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_residual(dtype):
    gen = torch.Generator().manual_seed(1)
    batch, seq, dim = sweep((2, 77, 3072), (2, 5, 72))
    x, y = _randn(batch, seq, dim, dtype=dtype, gen=gen), _randn(batch, seq, dim, dtype=dtype, gen=gen)
    (_, _, gate), = (_mods(batch, dim, 1, dtype, gen),)
    out, ref = gated_residual(x, gate, y), gated_residual_ref(x, gate, y)
    assert rel_err(out, ref) < TOL
    assert not BITWISE or dtype != torch.bfloat16 or torch.equal(out, ref)


def _rope_tables(seq, head_dim, gen):
    angles = torch.rand(seq, head_dim // 2, generator=gen, dtype=torch.float64) * 100
    return (angles.cos().repeat_interleave(2, dim=1).float().to(DEVICE),
            angles.sin().repeat_interleave(2, dim=1).float().to(DEVICE))


@pytest.mark.parametrize("heads,head_dim", sweep([(24, 128), (3, 64)], [(3, 16), (2, 32)]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_reads_strided_heads_and_writes_at_an_offset(heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(heads * head_dim)
    batch, num_txt, num_img = 2, sweep(7, 3), sweep(40, 5)
    total = num_txt + num_img
    cos, sin = _rope_tables(total, head_dim, gen)
    weight = _randn(head_dim, dtype=dtype, gen=gen, offset=1.0)
    # q as the single block sees it: a column slice of the fused projection [B, S, 3·H·D + more]
    proj = _randn(batch, total, 3 * heads * head_dim + 8, dtype=dtype, gen=gen, scale=3.0)
    q = proj[..., : heads * head_dim].unflatten(-1, (heads, head_dim))
    out, ref = qk_norm_rope(q, weight, 1e-6, cos, sin), qk_norm_rope_ref(q, weight, 1e-6, cos, sin)
    assert rel_err(out, ref) < TOL
    if dtype == torch.bfloat16 and not IS_INTERPRETED:
        assert (out != ref).float().mean() < 0.01
    # the double block: text and image halves written into one joint tensor, the tables indexed by position
    joint = torch.full((batch, total, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    txt, img = q[:, :num_txt], q[:, num_txt:]
    qk_norm_rope(txt, weight, 1e-6, cos, sin, out=joint, seq_offset=0)
    qk_norm_rope(img, weight, 1e-6, cos, sin, out=joint, seq_offset=num_txt)
    assert torch.isfinite(joint).all()  # every position written
    assert torch.equal(joint, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_writes_into_a_column_slice(dtype):
    gen = torch.Generator().manual_seed(5)
    rows, inter, head = sweep((33, 3072, 1024), (5, 48, 16))
    x = _randn(rows, 2 * inter, dtype=dtype, gen=gen)
    both = torch.zeros(rows, head + inter, dtype=dtype, device=DEVICE)
    silu_mul(x, out=both[:, head:])
    assert torch.equal(both[:, :head], torch.zeros_like(both[:, :head]))
    assert rel_err(both[:, head:], silu_mul_ref(x)) < TOL
    assert torch.equal(both[:, head:], silu_mul(x))


@pytest.mark.parametrize("batch,channels,size,groups", sweep([(1, 128, 256, 32), (2, 512, 64, 32), (3, 64, 9, 8)],
                                                              [(1, 8, 9, 4), (2, 16, 5, 4)]))
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_group_norm_split_over_programs(batch, channels, size, groups, silu, dtype):
    gen = torch.Generator().manual_seed(channels + size)
    # a large common offset: the chunk sums are shifted, so the variance must survive it
    x = _randn(batch, channels, size, size, dtype=dtype, gen=gen, scale=2.0, offset=40.0)
    weight, bias = _randn(channels, dtype=dtype, gen=gen, offset=1.0), _randn(channels, dtype=dtype, gen=gen)
    ref = group_norm_ref(x, groups, weight, bias, 1e-6, silu=silu)
    exact = group_norm_ref(x.double(), groups, weight.double(), bias.double(), 1e-6, silu=silu)
    for splits in (None, 1, 3):
        out = group_norm(x, groups, weight, bias, 1e-6, silu=silu, splits=splits)
        assert out.dtype == dtype and out.shape == x.shape
        _no_less_accurate(out, ref, exact)


def _tiny_transformer(dtype):
    from mstar_common.families.flux2_klein.tiny import TRANSFORMER
    from mstar_common.families.flux2_klein.transformer import Flux2Transformer, Flux2TransformerConfig

    torch.manual_seed(0)
    config = Flux2TransformerConfig.from_diffusers({**TRANSFORMER, "num_layers": 2, "num_attention_heads": 2,
                                                    "attention_head_dim": 32, "axes_dims_rope": (8, 8, 8, 8)})
    return _randomised(Flux2Transformer(config), dtype)


def _randomised(model: torch.nn.Module, dtype) -> torch.nn.Module:
    """Weights large enough that every block moves the activations (the tiny configs' inits are near zero)."""
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3 if param.dim() > 1 else 1.0)
    return model.eval().to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flux2_transformer_with_the_kernels_matches_eager(dtype):
    model = _tiny_transformer(dtype)
    gen = torch.Generator().manual_seed(2)
    batch, height, width, num_txt = 2, 4, 6, 5
    hidden = _randn(batch, height * width, model.config.in_channels, dtype=dtype, gen=gen)
    prompt = _randn(batch, num_txt, model.config.joint_attention_dim, dtype=dtype, gen=gen)
    timestep = torch.tensor([0.9, 0.3], device=DEVICE)
    txt_ids = torch.stack([torch.zeros(num_txt), torch.zeros(num_txt), torch.zeros(num_txt),
                           torch.arange(num_txt)], dim=1).long().to(DEVICE)
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(height), torch.arange(width),
                                   torch.arange(1)).to(DEVICE)
    rope = model.rope(txt_ids, img_ids)
    _fused_transformer_no_less_accurate(model, hidden, prompt, timestep, rope)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vae_decoder_with_the_group_norm_kernel_matches_eager(dtype):
    from mstar_common.families.flux2_klein.tiny import VAE
    from mstar_common.families.flux2_klein.vae import Flux2VaeConfig, VaeDecoder, use_fused_group_norm

    torch.manual_seed(0)
    model = VaeDecoder(Flux2VaeConfig.from_diffusers(VAE)).eval().to(DEVICE, dtype)
    tokens = _randn(2, 4 * 4, model.config.token_channels, dtype=dtype, gen=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        decoder = model.decoder
        latents = torch.randn(2, model.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(4))
        latents = latents.to(DEVICE, dtype)
        ref = decoder(latents)
        use_fused_group_norm(model, True)
        out = decoder(latents)
        pixels = model(tokens, 64, 64)
        use_fused_group_norm(model, False)
        exact = decoder.double()(latents.double())
    assert rel_err(out, ref) < 5 * TOL
    _no_less_accurate(out, ref, exact)
    assert pixels.shape == (2, 64, 64, 3) and pixels.dtype == torch.uint8


# Z-Image


@pytest.mark.parametrize("batch,seq,dim", sweep([(1, 300, 3840), (2, 17, 1000)], [(2, 5, 96), (1, 3, 40)]))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_modulate_and_the_gated_rms_residual(batch, seq, dim, dtype):
    gen = torch.Generator().manual_seed(seq * dim)
    x = _randn(batch, seq, dim, dtype=dtype, gen=gen, scale=2.0)
    y = _randn(batch, seq, dim, dtype=dtype, gen=gen, scale=5.0)
    weight, y_weight = _randn(dim, dtype=dtype, gen=gen, offset=1.0), _randn(dim, dtype=dtype, gen=gen, offset=1.0)
    # scale and gate as the block makes them: fresh [B, 1, D] tensors (1 + scale, tanh(gate))
    scale = (1.0 + _randn(batch, 1, dim, dtype=dtype, gen=gen, scale=0.3))
    gate = _randn(batch, 1, dim, dtype=dtype, gen=gen).tanh()
    out, ref = rms_modulate(x, weight, 1e-5, scale), rms_modulate_ref(x, weight, 1e-5, scale)
    assert rel_err(out, ref) < TOL
    res, res_ref = gated_rms_residual(x, y, y_weight, 1e-5, gate), gated_rms_residual_ref(x, y, y_weight, 1e-5, gate)
    assert rel_err(res, res_ref) < TOL
    (res2, out2) = gated_rms_residual_modulate(x, y, y_weight, 1e-5, gate, weight, 1e-5, scale)
    (res2_ref, out2_ref) = gated_rms_residual_modulate_ref(x, y, y_weight, 1e-5, gate, weight, 1e-5, scale)
    assert torch.equal(res2, res) and rel_err(out2, out2_ref) < TOL
    if dtype == torch.bfloat16 and not IS_INTERPRETED:  # the same roundings; only the sums' order differs
        for got, want in ((out, ref), (res, res_ref), (out2, out2_ref)):
            assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_pair(dtype):
    gen = torch.Generator().manual_seed(7)
    rows, inter = sweep((33, 10240), (5, 48))
    gate, up = _randn(rows, inter, dtype=dtype, gen=gen), _randn(rows, inter, dtype=dtype, gen=gen)
    out, ref = silu_mul_pair(gate, up), silu_mul_pair_ref(gate, up)
    assert rel_err(out, ref) < TOL
    assert torch.equal(out, silu_mul(torch.cat([gate, up], dim=1)))


def test_rope_tables_from_complex_rotate_as_the_complex_product():
    from mstar_common.families.z_image_turbo.transformer import apply_rope

    gen = torch.Generator().manual_seed(8)
    seq, heads, head_dim = 11, 3, 16
    angles = torch.rand(seq, head_dim // 2, generator=gen) * 50
    freqs = torch.polar(torch.ones_like(angles), angles)
    cos, sin = rope_tables_from_complex(freqs)
    x = _randn(2, seq, heads, head_dim, dtype=torch.float32, gen=gen)
    ones = torch.ones(head_dim, device=DEVICE)
    # a unit weight: the kernel is the eager RMSNorm followed by the complex product
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    got = qk_norm_rope(x, ones, 1e-6, cos.to(DEVICE), sin.to(DEVICE))
    want = apply_rope(normed, freqs.to(DEVICE))
    assert rel_err(got, want) < 1e-5


def _tiny_z_image(dtype):
    from mstar_common.families.z_image_turbo.tiny import TRANSFORMER
    from mstar_common.families.z_image_turbo.transformer import ZImageTransformer, ZImageTransformerConfig

    torch.manual_seed(0)
    return _randomised(ZImageTransformer(ZImageTransformerConfig.from_diffusers(TRANSFORMER)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_z_image_transformer_with_the_kernels_matches_eager(dtype):
    from mstar_common.families.z_image_turbo.transformer import padded_length

    model = _tiny_z_image(dtype)
    gen = torch.Generator().manual_seed(9)
    batch, height, width, caption_len = 2, 3, 5, 7
    tokens = _randn(batch, height * width, model.config.token_channels, dtype=dtype, gen=gen)
    feats = _randn(caption_len, model.config.cap_feat_dim, dtype=dtype, gen=gen)
    t = torch.tensor([0.8, 0.25], device=DEVICE)
    with torch.inference_mode():
        caption = model.encode_caption(feats).expand(batch, -1, -1)
        rope = model.rope(height, width, padded_length(caption_len))
    _fused_transformer_no_less_accurate(model, tokens, caption, t, rope)
