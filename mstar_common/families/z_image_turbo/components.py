"""The three Z-Image-Turbo components as the Triton nodes run them: parse a request's tensors (refusing bad input
with a ValueError naming the field), then hand it to the component's engine, which batches across requests and
calls back with the output tensors (float32 / uint8 on the CPU: the wire format).

The runtimes have klein's interface (`engine`, `submit(request_id, inputs, on_done, is_cancelled)`), so
`backends/stateless_node.py`, `backends/denoise_node.py` and the in-process harness run them unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mstar_common.diffusion.batcher import BatchingEngine, OnDone
from mstar_common.diffusion.denoise import DenoiseEngine, DenoiseJob
from mstar_common.diffusion.step_graphs import StepGraphs, StepShapes
from mstar_common.families.flux2_klein.components import MAX_CACHED_LAYOUTS, MAX_SEED, Inputs, scalar
from mstar_common.families.flux2_klein.text_encoder import Qwen3TapEncoder
from mstar_common.families.z_image_turbo import graph as g
from mstar_common.families.z_image_turbo.options import TEXT_TOKENS
from mstar_common.families.z_image_turbo.scheduler import ZImageSchedulerConfig, z_image_schedule
from mstar_common.families.z_image_turbo.transformer import ZImageTransformer, padded_length, patchify, unpatchify
from mstar_common.families.z_image_turbo.vae import VaeDecoder
from mstar_common.images import check_geometry


class _Component:
    engine: BatchingEngine

    def parse(self, inputs: Inputs):
        raise NotImplementedError

    def submit(self, request_id: str, inputs: Inputs, on_done: OnDone,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """Parse (a ValueError here is the client's fault) and enqueue; `on_done(outputs, error)` follows."""
        self.engine.submit(request_id, self.parse(inputs), on_done, is_cancelled)


# text encoder


class TextEncoderComponent(_Component):
    """Qwen3 run to its second-to-last layer over the padded 512 ids; answers the real tokens' rows only."""

    def __init__(self, model: Qwen3TapEncoder, device: str, max_batch: int):
        self.model, self.device = model, torch.device(device)
        self.vocab_size = model.config.vocab_size
        self.engine = BatchingEngine("z_image_turbo/text_encoder", self.run_batch, max_rows=max_batch)

    def parse(self, inputs: Inputs) -> tuple[torch.Tensor, int]:
        ids = inputs.get(g.INPUT_IDS)
        if ids is None or ids.numel() != TEXT_TOKENS:
            raise ValueError(f"{g.INPUT_IDS}: the text encoder takes exactly {TEXT_TOKENS} (padded) ids")
        text_len = scalar(inputs, g.TEXT_LEN)
        if not 1 <= text_len <= TEXT_TOKENS:
            raise ValueError(f"{g.TEXT_LEN}: must be in [1, {TEXT_TOKENS}], got {text_len}")
        ids = ids.reshape(-1).to(torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"{g.INPUT_IDS}: ids must be in [0, {self.vocab_size})")
        return ids, text_len

    @torch.inference_mode()
    def run_batch(self, payloads: list[tuple[torch.Tensor, int]]) -> list[Inputs]:
        ids = torch.stack([p[0] for p in payloads]).to(self.device)
        lens = torch.tensor([p[1] for p in payloads], device=self.device)
        out = self.model(ids, lens).float().cpu()
        return [{g.PROMPT_EMBEDS: row[:length]} for row, (_, length) in zip(out, payloads, strict=True)]


# denoise


@dataclass(frozen=True, slots=True)
class Layout:
    """What rows of one batched step share: the output token grid and the padded caption length."""

    height: int  # tokens
    width: int
    caption_tokens: int

    @property
    def num_tokens(self) -> int:
        return self.height * self.width


def euler_step(model: ZImageTransformer, rope: tuple[torch.Tensor, torch.Tensor], latents: torch.Tensor,
               caption: torch.Tensor, timesteps: torch.Tensor, dts: torch.Tensor) -> torch.Tensor:
    """One step of every row in the reference's arithmetic: the model sees t = (1000 - timestep) / 1000 and predicts
    the negated velocity; the float32 latents move by `(sigma' - sigma) * (-output)`."""
    t = (1000 - timesteps) / 1000
    output = model(latents.to(model.dtype), caption.to(model.dtype), t, rope).float()
    return latents + dts[:, None, None] * -output


class ZImageStepper:
    """The denoise engine's step: captured graph when a bucket fits, eager otherwise. RoPE tables per layout."""

    def __init__(self, model: ZImageTransformer, device: torch.device):
        self.model, self.device = model, device
        self.graphs: StepGraphs | None = None
        self._ropes: dict[Layout, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
        if layout not in self._ropes:
            if len(self._ropes) >= MAX_CACHED_LAYOUTS:  # clients choose sizes and prompts: keep the cache bounded
                self._ropes.pop(next(iter(self._ropes)))
            self._ropes[layout] = self.model.rope(layout.height, layout.width, layout.caption_tokens)
        return self._ropes[layout]

    def step_fn(self, layout: Layout):
        rope = self.rope(layout)

        def step(latents, prompt_embeds, ref_tokens, timesteps, dts):
            return euler_step(self.model, rope, latents, prompt_embeds, timesteps, dts)

        return step

    def __call__(self, layout: Layout, latents, prompt_embeds, ref_tokens, timesteps, dts) -> torch.Tensor:
        if self.graphs is not None:
            out = self.graphs.run(layout, latents, prompt_embeds, None, timesteps, dts)
            if out is not None:
                return out
        return self.step_fn(layout)(latents, prompt_embeds, None, timesteps, dts)

    def capture(self, layouts: list[Layout], batches: list[int], *, capture: bool = True) -> None:
        config = self.model.config
        step_fns = {layout: (self.step_fn(layout), StepShapes(layout.num_tokens, config.token_channels,
                                                              layout.caption_tokens, config.dim))
                    for layout in layouts}
        self.graphs = StepGraphs()
        with torch.no_grad():  # float32 buffers: the sampler's latents are float32 whatever the model dtype
            self.graphs.capture(step_fns, batches, dtype=torch.float32, device=self.device, capture=capture)


@dataclass(frozen=True, slots=True)
class DenoiseLimits:
    multiple: int  # pixels per token side
    max_area: int
    max_images: int
    max_steps: int
    default_steps: int


class DenoiseComponent(_Component):
    def __init__(self, model: ZImageTransformer, scheduler: ZImageSchedulerConfig, limits: DenoiseLimits,
                 device: str, max_batch: int):
        self.model, self.scheduler, self.limits = model, scheduler, limits
        self.device = torch.device(device)
        self.stepper = ZImageStepper(model, self.device)
        self.engine = DenoiseEngine("z_image_turbo/denoise", self.stepper, max_rows=max_batch, device=self.device)

    def layout_for(self, width: int, height: int, text_len: int) -> Layout:
        return Layout(height // self.limits.multiple, width // self.limits.multiple, padded_length(text_len))

    def submit(self, request_id: str, inputs: Inputs, on_done: OnDone,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        job = self.parse(inputs)
        job.request_id, job.is_cancelled = request_id, is_cancelled
        job.on_done = lambda latents, error: on_done(None if error else self.finish(job.layout, latents), error)
        self.engine.submit(job)

    def parse(self, inputs: Inputs) -> DenoiseJob:
        lim = self.limits
        width, height = scalar(inputs, g.WIDTH), scalar(inputs, g.HEIGHT)
        check_geometry(width, height, lim.multiple, lim.max_area)
        num_images = scalar(inputs, g.NUM_IMAGES, 1)
        if not 1 <= num_images <= lim.max_images:
            raise ValueError(f"n: must be in [1, {lim.max_images}], got {num_images}")
        steps = scalar(inputs, g.NUM_STEPS, lim.default_steps)
        if not 1 <= steps <= lim.max_steps:
            raise ValueError(f"num_inference_steps: must be in [1, {lim.max_steps}], got {steps}")
        seed = scalar(inputs, g.SEED)
        if not 0 <= seed <= MAX_SEED:
            raise ValueError(f"seed: must be in [0, {MAX_SEED}], got {seed}")
        prompt = self._prompt(inputs)
        layout = self.layout_for(width, height, prompt.shape[0])
        self._check_rope_range(layout, width, height)
        with torch.inference_mode():  # the caption refiner has no timestep input: run it once, not every step
            caption = self.model.encode_caption(prompt.to(self.device, self.model.dtype))
        timesteps, sigmas = z_image_schedule(self.scheduler, steps, layout.num_tokens)
        return DenoiseJob(
            request_id="", layout=layout, latents=self._noise(seed, num_images, layout),
            prompt_embeds=caption[None].expand(num_images, -1, -1), ref_tokens=None,
            timesteps=timesteps.tolist(), sigmas=sigmas.tolist(), on_done=lambda *_: None,
        )

    def _prompt(self, inputs: Inputs) -> torch.Tensor:
        prompt = inputs.get(g.PROMPT_EMBEDS)
        width = self.model.config.cap_feat_dim
        if prompt is None or prompt.dim() != 2 or prompt.shape[1] != width or not 1 <= prompt.shape[0] <= TEXT_TOKENS:
            raise ValueError(f"{g.PROMPT_EMBEDS}: expected shape [L, {width}] with 1 <= L <= {TEXT_TOKENS}")
        return prompt

    def _check_rope_range(self, layout: Layout, width: int, height: int) -> None:
        """Positions past the checkpoint's RoPE tables (`axes_lens`) were never trained; refuse them."""
        frames, rows, cols = self.model.config.axes_lens
        if layout.caption_tokens + 1 >= frames:
            raise ValueError(f"prompt: {layout.caption_tokens} caption tokens exceed this checkpoint's RoPE range "
                             f"({frames - 2}); shorten the prompt")
        if layout.height >= rows or layout.width >= cols:
            raise ValueError(f"size: {width}x{height} exceeds this checkpoint's RoPE range of "
                             f"{(cols - 1) * self.limits.multiple}x{(rows - 1) * self.limits.multiple}")

    def _noise(self, seed: int, num_images: int, layout: Layout) -> torch.Tensor:
        """The reference's initial noise: one CPU generator per request, float32, then patchified."""
        generator = torch.Generator("cpu").manual_seed(seed)
        patch = self.model.config.patch_size
        shape = (num_images, self.model.config.in_channels, layout.height * patch, layout.width * patch)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        return patchify(noise, patch).to(self.device)

    def finish(self, layout: Layout, latents: torch.Tensor) -> Inputs:
        patch = self.model.config.patch_size
        return {g.LATENTS: unpatchify(latents.float().cpu(), layout.height, layout.width, patch)}


# VAE decode


class VaeDecodeComponent(_Component):
    def __init__(self, model: VaeDecoder, device: str, max_batch: int, max_area: int):
        self.model, self.device, self.max_area = model, torch.device(device), max_area
        self.multiple = 2 * model.config.scale_factor  # the DiT's 2×2 patches over the VAE's ×8
        self.engine = BatchingEngine("z_image_turbo/vae_decode", self.run_batch, max_rows=max_batch,
                                     key_of=lambda p: tuple(p.shape[1:]), rows_of=lambda p: p.shape[0])

    def parse(self, inputs: Inputs) -> torch.Tensor:
        width, height = scalar(inputs, g.WIDTH), scalar(inputs, g.HEIGHT)
        check_geometry(width, height, self.multiple, self.max_area)
        latents = inputs.get(g.LATENTS)
        factor = self.model.config.scale_factor
        want = (self.model.config.latent_channels, height // factor, width // factor)
        if latents is None or latents.dim() != 4 or tuple(latents.shape[1:]) != want:
            raise ValueError(f"{g.LATENTS}: expected [n, {', '.join(map(str, want))}] for {width}x{height}")
        return latents

    @torch.inference_mode()
    def run_batch(self, payloads: list[torch.Tensor]) -> list[Inputs]:
        latents = torch.cat(payloads).to(self.device, self.model.dtype)
        pixels = self.model(latents).cpu()
        return [{g.PIXELS: part} for part in pixels.split([p.shape[0] for p in payloads])]
