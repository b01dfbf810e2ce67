"""What the image families' components share: a runtime's `submit` (parse, then enqueue), the padded-prompt text
encoder, the denoise request's limits and scalars, and a stepper that replays a captured graph when a bucket fits
and keeps a bounded RoPE cache per layout. The families supply the forward passes, layouts and noise.

Each runtime exposes `engine` (start / submit / shutdown / stats) and `submit(request_id, inputs, on_done,
is_cancelled)`; `backends/stateless_node.py` and `backends/denoise_node.py` wrap them for Triton, and the
in-process harness (tests, benchmark) calls them directly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from mstar_common.config import env_switch
from mstar_common.diffusion import image_graph as g
from mstar_common.diffusion.batcher import BatchingEngine, OnDone
from mstar_common.diffusion.denoise import DenoiseJob
from mstar_common.diffusion.png import paeth_filter
from mstar_common.diffusion.step_graphs import StepGraphs, StepShapes, capture_graph
from mstar_common.engine.capture_policy import capture_or_skip
from mstar_common.images import check_geometry

Inputs = dict[str, torch.Tensor]
TIMINGS = env_switch("MSTAR_TIMINGS", False)  # the in-process decoder logs its wait and its decode
logger = logging.getLogger(__name__)
MAX_SEED = 2**63 - 1
MAX_CACHED_LAYOUTS = 64  # RoPE tables kept (a captured layout's graph holds its own)


def scalar(inputs: Inputs, name: str, default: int | None = None) -> int:
    if name not in inputs:
        if default is None:
            raise ValueError(f"{name}: required")
        return default
    value = inputs[name].reshape(-1)
    if value.numel() != 1:
        raise ValueError(f"{name}: expected one value, got {value.numel()}")
    return int(value[0])


def wants_png_rows(inputs: Inputs) -> bool:
    """The request's `want_png_rows` (0 or 1, default 0): answer PNG rows instead of pixels."""
    value = scalar(inputs, g.WANT_PNG_ROWS, 0)
    if value not in (0, 1):
        raise ValueError(f"{g.WANT_PNG_ROWS}: must be 0 or 1, got {value}")
    return bool(value)


def host_image(pixels: torch.Tensor, png_rows: bool) -> Inputs:
    """One request's decoded images, uint8 `[n, H, W, C]` where the VAE ran -> its answer on the host: the pixels,
    or (`png_rows`, on a GPU) their PNG scanlines `[n, H, 1 + W*C]`, Paeth-filtered there (~0.1 ms against 5-75 ms
    on the walk's CPU; the walk then only deflates them). A decoder on the CPU answers pixels: the walk's strip
    filter beats torch's CPU ops beside the other busy processes (mstar_common/diffusion/png.py)."""
    if not png_rows or pixels.device.type != "cuda":
        return {g.PIXELS: pixels.cpu()}
    n, height, width, channels = pixels.shape
    return {g.PNG_ROWS: paeth_filter(pixels.reshape(n, height, width * channels), channels).cpu()}


class Component:
    engine: Any

    def parse(self, inputs: Inputs) -> Any:
        raise NotImplementedError

    def submit(self, request_id: str, inputs: Inputs, on_done: OnDone,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        """Parse (a ValueError here is the client's fault) and enqueue; `on_done(outputs, error)` follows."""
        self.engine.submit(request_id, self.parse(inputs), on_done, is_cancelled)


# text encoder


class TextEncoderComponent(Component):
    """A text encoder over `text_tokens` padded ids and each row's real length; answers the whole padded rows
    (`embeds` may trim them)."""

    def __init__(self, name: str, model: torch.nn.Module, device: str, max_batch: int, text_tokens: int):
        self.model, self.device, self.text_tokens = model, torch.device(device), text_tokens
        self.vocab_size = model.config.vocab_size
        self.max_batch = max_batch
        self.graphs: TextGraphs | None = None
        self.engine = BatchingEngine(name, self.run_batch, max_rows=max_batch)
        self.engine.graph_replays = lambda: self.graphs.num_replays if self.graphs is not None else 0

    def capture_graphs(self, capture: bool = True) -> None:
        """Capture the forward at batch 1, 2, 4, ... up to `max_batch` (`capture=False`: the same buckets run
        eager, which is how the CPU tests check the padding)."""
        batches = sorted({min(1 << k, self.max_batch) for k in range(self.max_batch.bit_length() + 1)})
        self.graphs = TextGraphs(self.model, self.device, batches, self.text_tokens, capture)

    def parse(self, inputs: Inputs) -> tuple[torch.Tensor, int]:
        ids, num = inputs.get(g.INPUT_IDS), self.text_tokens
        if ids is None or ids.numel() != num:
            raise ValueError(f"{g.INPUT_IDS}: the text encoder takes exactly {num} (padded) ids")
        if g.TEXT_LEN not in inputs:
            raise ValueError(f"{g.TEXT_LEN}: the text encoder needs each row's text_len (its number of real "
                             "tokens before the padding) to mask the padding")
        text_len = scalar(inputs, g.TEXT_LEN)
        if not 1 <= text_len <= num:
            raise ValueError(f"{g.TEXT_LEN}: must be in [1, {num}], got {text_len}")
        ids = ids.reshape(-1).to(torch.int64)
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"{g.INPUT_IDS}: ids must be in [0, {self.vocab_size})")
        return ids, text_len

    @torch.inference_mode()
    def run_batch(self, payloads: list[tuple[torch.Tensor, int]]) -> list[Inputs]:
        ids = torch.stack([p[0] for p in payloads]).to(self.device)
        lens = torch.tensor([p[1] for p in payloads], device=self.device)
        out = self.graphs.run(ids, lens) if self.graphs is not None else self.model(ids, lens)
        out = out.cpu()  # the model dtype; the node sends it in the deployment's wire dtype
        return [{g.PROMPT_EMBEDS: self.embeds(row, length)} for row, (_, length) in zip(out, payloads, strict=True)]

    def embeds(self, row: torch.Tensor, text_len: int) -> torch.Tensor:
        return row


class TextGraphs:
    """The text encoder's forward captured per batch bucket over static `[B, text_tokens]` buffers.

    A batch of n rows replays the smallest bucket of at least n; the spare rows hold one token (length 1, so no
    row is all padding) and are dropped. The mask is always built (`static=True`), so an unpadded prompt gets a
    causal mask instead of the eager path's `is_causal` attention: the same arithmetic, another SDPA kernel.
    Captured, the ~800 kernels of a 27-layer Qwen3-4B pass launch as one graph: the eager pass is bound by
    their launches (H200: ~44 ms of host time for ~13 ms of GPU work at one 512-token prompt).
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, batches: list[int], text_tokens: int,
                 capture: bool = True):
        self.model = model
        self.buckets: list[tuple[int, torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph | None,
                                 torch.Tensor | None]] = []
        pool = torch.cuda.graph_pool_handle() if capture else None
        for batch in sorted(set(batches), reverse=True):  # largest first: the pool is sized by the first
            ids = torch.zeros(batch, text_tokens, dtype=torch.int64, device=device)
            lens = torch.ones(batch, dtype=torch.int64, device=device)
            graph, out = None, None
            if capture:
                with torch.inference_mode():
                    captured = capture_or_skip(
                        f"[cuda graphs] text encoder batch {batch}",
                        lambda ids=ids, lens=lens: capture_graph(lambda: model(ids, lens, static=True), pool))
                if captured is None:  # out of GPU memory: a larger bucket or the eager pass takes these batches
                    continue
                graph, out = captured
            self.buckets.append((batch, ids, lens, graph, out))
        self.buckets.sort(key=lambda bucket: bucket[0])
        self.num_replays = 0

    def run(self, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        rows = ids.shape[0]
        bucket = next((b for b in self.buckets if b[0] >= rows), None)
        if bucket is None:
            return self.model(ids, lens)
        _, static_ids, static_lens, graph, out = bucket
        static_ids[:rows].copy_(ids)
        static_lens[:rows].copy_(lens)
        static_ids[rows:].zero_()
        static_lens[rows:].fill_(1)
        if graph is None:
            return self.model(static_ids, static_lens, static=True)[:rows]
        graph.replay()
        self.num_replays += 1
        return out[:rows].clone()


# denoise


@dataclass(frozen=True, slots=True)
class DenoiseLimits:
    multiple: int  # pixels per token side
    max_area: int
    max_images: int
    max_steps: int
    default_steps: int

    @classmethod
    def from_options(cls, options: Any, multiple: int) -> DenoiseLimits:
        """The limits of an image family's options (`max_image_area`, `max_images_per_request`, ...)."""
        return cls(multiple=multiple, max_area=options.max_image_area, max_images=options.max_images_per_request,
                   max_steps=options.max_inference_steps, default_steps=options.default_num_inference_steps)


@dataclass(frozen=True, slots=True)
class DenoiseScalars:
    width: int
    height: int
    num_images: int
    num_steps: int
    seed: int


def parse_denoise_scalars(inputs: Inputs, lim: DenoiseLimits) -> DenoiseScalars:
    """Size, n, steps and seed of a denoise request, each refused with a ValueError naming the field."""
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
    return DenoiseScalars(width, height, num_images, steps, seed)


class DenoiseComponent(Component):
    """Base of a family's denoise runtime: `parse` builds a `DenoiseJob`, `finish` turns its latents into outputs.

    With a decoder attached (`attach_decoder`, the deployment's `vae_in_denoise`), a finished job's latents go to
    that VAE decode component in this process instead, and the request is answered with its pixels: the walk then
    skips its hop to the vae_decode component."""

    decoder: LocalDecoder | None = None

    def submit(self, request_id: str, inputs: Inputs, on_done: OnDone,
               is_cancelled: Callable[[], bool] = lambda: False) -> None:
        job = self.parse(inputs)
        job.request_id, job.is_cancelled = request_id, is_cancelled
        job.png_rows = wants_png_rows(inputs)  # for the in-process decoder (without one the answer is latents)
        if self.decoder is None:
            job.on_done = lambda latents, error: self._answer(job, latents, error, on_done)
        else:
            job.on_done = lambda latents, error: self._decode(job, latents, error, on_done)
        self.engine.submit(job)

    def _answer(self, job: DenoiseJob, latents: torch.Tensor | None, error: BaseException | None,
                on_done: OnDone) -> None:
        """On the denoise thread: answer with the finished job's outputs. A `finish` that raises (its copy to the
        host is where an eager step's asynchronous CUDA error surfaces) fails the request; the engine only logged
        it, and the walk waited out its deadline for an answer."""
        if error is None:
            try:
                outputs = self.finish(job.layout, latents)
            except Exception as exc:  # noqa: BLE001 - this request fails, the loop goes on
                on_done(None, exc)
                return
            on_done(outputs, None)
        else:
            on_done(None, error)

    def _decode(self, job: DenoiseJob, latents: torch.Tensor | None, error: BaseException | None,
                on_done: OnDone) -> None:
        """On the denoise thread: hand a finished job's latents to the in-process decoder."""
        if error is not None:
            on_done(None, error)
            return
        try:
            self.decoder.submit(job.request_id, self.decode_payload(job.layout, latents, job.png_rows), on_done,
                                job.is_cancelled)
        except Exception as exc:  # noqa: BLE001 - e.g. the decoder shut down: this request fails, the loop goes on
            on_done(None, exc)

    def attach_decoder(self, decoder: Component) -> None:
        """Decode in this process: `decoder` is the family's VAE decode component, built on this device."""
        self.decoder = LocalDecoder(decoder)
        self.engine.companions.append(self.decoder.engine)

    def parse(self, inputs: Inputs) -> DenoiseJob:
        raise NotImplementedError

    def finish(self, layout: Any, latents: torch.Tensor) -> Inputs:
        raise NotImplementedError

    def decode_payload(self, layout: Any, latents: torch.Tensor, png_rows: bool) -> Any:
        """What the VAE decode component's `parse` would make of `finish`'s outputs (and `want_png_rows`), from
        the latents on the device and as a copy (the step's captured output buffer is overwritten by the next
        replay)."""
        raise NotImplementedError


class LocalDecoder:
    """A VAE decode component run inside the denoise process: its own batching thread, and on a GPU its own
    CUDA stream, so a decode overlaps the next denoise steps instead of waiting behind them. Each payload
    carries an event recorded on the denoise thread's stream after its latents were copied; the decode stream
    waits for it, and the copy is marked as used by that stream (the caching allocator then keeps it)."""

    def __init__(self, decoder: Component):
        self.decoder = decoder
        inner = decoder.engine
        self.stream = torch.cuda.Stream(decoder.device) if decoder.device.type == "cuda" else None
        self.engine = BatchingEngine(f"{inner.name}/in-denoise", self._run_batch, max_rows=inner.max_rows,
                                     key_of=lambda p: inner.key_of(p[0]), rows_of=lambda p: inner.rows_of(p[0]))

    def submit(self, request_id: str, payload: Any, on_done: OnDone, is_cancelled: Callable[[], bool]) -> None:
        event = None
        if self.stream is not None:
            for tensor in payload if isinstance(payload, tuple) else (payload,):
                if isinstance(tensor, torch.Tensor):
                    tensor.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record()
        self.engine.submit(request_id, (payload, event), on_done, is_cancelled)

    def _run_batch(self, items: list[tuple[Any, torch.cuda.Event | None]]) -> list[Inputs]:
        if self.stream is None:
            return self.decoder.run_batch([payload for payload, _ in items])
        started = time.perf_counter()
        if TIMINGS:  # the denoise steps' end, apart from the decode's own time
            for _, event in items:
                event.synchronize()
            waited = time.perf_counter()
            logger.info("[%s] timing vae_wait_for_steps: %.1f ms", self.engine.name, (waited - started) * 1e3)
            started = waited
        with torch.cuda.stream(self.stream):
            for _, event in items:
                self.stream.wait_event(event)
            outputs = self.decoder.run_batch([payload for payload, _ in items])
        if TIMINGS:
            logger.info("[%s] timing vae_in_denoise: %.1f ms for %d", self.engine.name,
                        (time.perf_counter() - started) * 1e3, len(items))
        return outputs


class BucketedStepper:
    """The denoise engine's step: captured graph when a bucket fits, eager otherwise. RoPE tables per layout.

    A family supplies `make_rope(layout)`, `step(rope, latents, prompt_embeds, ref_tokens, timesteps, dts)`,
    `shapes(layout)` (the captured buffers) and `buffer_dtype`."""

    buffer_dtype: torch.dtype

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.graphs: StepGraphs | None = None
        self._ropes: dict[Hashable, Any] = {}

    def make_rope(self, layout: Any) -> Any:
        raise NotImplementedError

    def step(self, rope: Any, latents, prompt_embeds, ref_tokens, timesteps, dts) -> torch.Tensor:
        raise NotImplementedError

    def shapes(self, layout: Any) -> StepShapes:
        raise NotImplementedError

    def rope(self, layout: Any) -> Any:
        if layout not in self._ropes:
            if len(self._ropes) >= MAX_CACHED_LAYOUTS:  # clients choose sizes and prompts: keep the cache bounded
                self._ropes.pop(next(iter(self._ropes)))
            self._ropes[layout] = self.make_rope(layout)
        return self._ropes[layout]

    def step_fn(self, layout: Any):
        rope = self.rope(layout)

        def step(latents, prompt_embeds, ref_tokens, timesteps, dts):
            return self.step(rope, latents, prompt_embeds, ref_tokens, timesteps, dts)

        return step

    def rows_to_run(self, layout: Any, rows: int) -> int:
        """The engine's step size for `rows` waiting rows (StepGraphs.rows_to_run; all of them when eager)."""
        return rows if self.graphs is None else self.graphs.rows_to_run(layout, rows)

    def __call__(self, layout: Any, latents, prompt_embeds, ref_tokens, timesteps, dts) -> torch.Tensor:
        if self.graphs is not None:
            out = self.graphs.run(layout, latents, prompt_embeds, ref_tokens, timesteps, dts)
            if out is not None:
                return out
        return self.step_fn(layout)(latents, prompt_embeds, ref_tokens, timesteps, dts)

    def capture(self, layouts: list[Any], batches: list[int], *, capture: bool = True) -> None:
        step_fns = {layout: (self.step_fn(layout), self.shapes(layout)) for layout in layouts}
        self.graphs = StepGraphs()
        with torch.no_grad():  # not inference_mode: the static buffers must stay writable outside it
            self.graphs.capture(step_fns, batches, dtype=self.buffer_dtype, device=self.device, capture=capture)


def decode_slices(latents: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The rows one VAE forward takes: on a GPU one image at a time. H200, 1024x1024, bf16 with the GroupNorm
    kernel (scripts/bench_dit_kernels.py): 38 ms for one image, 63 ms per image at batch 2 and 4; the batch
    gathers requests all the same (the engine's batching) and the decodes run back to back."""
    return latents.split(1) if device.type == "cuda" else (latents,)
