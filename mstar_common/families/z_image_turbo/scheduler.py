"""The Z-Image-Turbo sampler schedule, as `ZImagePipeline` drives diffusers' FlowMatchEulerDiscreteScheduler:
sigmas from 1 to 1/n (a float32 `torch.linspace`), shifted (a fixed `shift`, or the linear-in-resolution `mu` when
the checkpoint enables dynamic shifting), then one Euler step per sigma. The shifting arithmetic is klein's
(`flux2_klein/scheduler.py`); only the base sigmas and `mu` differ, so the timesteps are bit-identical to the
reference pipeline's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mstar_common.families.flux2_klein.scheduler import FlowSchedulerConfig, flow_schedule


@dataclass(frozen=True, slots=True)
class ZImageSchedulerConfig:
    flow: FlowSchedulerConfig
    base_image_seq_len: int = 256  # the linear mu runs from base_shift at this many tokens ...
    max_image_seq_len: int = 4096  # ... to max_shift at this many
    base_shift: float = 0.5
    max_shift: float = 1.15

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> ZImageSchedulerConfig:
        return cls(
            flow=FlowSchedulerConfig.from_diffusers(config),
            base_image_seq_len=int(config.get("base_image_seq_len", 256)),
            max_image_seq_len=int(config.get("max_image_seq_len", 4096)),
            base_shift=float(config.get("base_shift", 0.5)),
            max_shift=float(config.get("max_shift", 1.15)),
        )

    def mu(self, image_seq_len: int) -> float:
        slope = (self.max_shift - self.base_shift) / (self.max_image_seq_len - self.base_image_seq_len)
        return image_seq_len * slope + (self.base_shift - slope * self.base_image_seq_len)


def z_image_schedule(config: ZImageSchedulerConfig, num_steps: int,
                     image_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps `[n]`, sigmas `[n + 1]`, the last 0), float32 on the CPU; `image_seq_len` = 2×2-patch tokens."""
    base = np.array(torch.linspace(1.0, 1 / num_steps, num_steps).tolist()).astype(np.float32)
    return flow_schedule(config.flow, num_steps, image_seq_len, sigmas=base, mu=config.mu(image_seq_len))
