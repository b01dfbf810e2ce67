"""The rectified-flow Euler schedule of FLUX.2 [klein] (diffusers' FlowMatchEulerDiscreteScheduler, as the klein
pipeline drives it): sigmas spaced linearly from 1 to 1/n, shifted by a resolution-dependent mu, then one
Euler step per sigma: `x <- x + (sigma_next - sigma) * v`.

The arithmetic (float32 NumPy for the sigmas, like the reference) is reproduced exactly, so a request's
timesteps are bit-identical to the reference pipeline's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_UNSUPPORTED = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "stochastic_sampling",
                "invert_sigmas", "use_flow_sigmas")


@dataclass(frozen=True, slots=True)
class FlowSchedulerConfig:
    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    shift_terminal: float | None = None

    @classmethod
    def from_diffusers(cls, config: Mapping[str, Any]) -> FlowSchedulerConfig:
        name = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
        if name != "FlowMatchEulerDiscreteScheduler":
            raise ValueError(f"scheduler {name!r} is not supported: only FlowMatchEulerDiscreteScheduler is")
        if enabled := [key for key in _UNSUPPORTED if config.get(key)]:
            raise ValueError(f"scheduler options {enabled} are not supported")
        shift_type = config.get("time_shift_type", "exponential")
        if shift_type not in ("exponential", "linear"):
            raise ValueError(f"scheduler time_shift_type={shift_type!r} must be 'exponential' or 'linear'")
        return cls(
            num_train_timesteps=int(config.get("num_train_timesteps", 1000)),
            shift=float(config.get("shift", 1.0)),
            use_dynamic_shifting=bool(config.get("use_dynamic_shifting", False)),
            time_shift_type=shift_type,
            shift_terminal=config.get("shift_terminal"),
        )


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The klein pipeline's resolution- and step-count-dependent shift."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


def flow_schedule(config: FlowSchedulerConfig, num_steps: int, image_seq_len: int, *,
                  sigmas: np.ndarray | None = None, mu: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(timesteps `[n]`, sigmas `[n + 1]`, the last 0), float32 on the CPU. `sigmas` (float32, before the shift)
    and `mu` default to klein's: linear from 1 to 1/n, and `empirical_mu`."""
    if sigmas is None:
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    if config.use_dynamic_shifting:
        mu = empirical_mu(image_seq_len, num_steps) if mu is None else mu
        if config.time_shift_type == "exponential":
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
        else:
            sigmas = mu / (mu + (1 / sigmas - 1) ** 1.0)
    else:
        sigmas = config.shift * sigmas / (1 + (config.shift - 1) * sigmas)
    if config.shift_terminal:
        one_minus = 1 - sigmas
        sigmas = 1 - (one_minus / (one_minus[-1] / (1 - config.shift_terminal)))
    sigmas_t = torch.from_numpy(np.asarray(sigmas)).to(dtype=torch.float32)
    timesteps = sigmas_t * config.num_train_timesteps
    return timesteps, torch.cat([sigmas_t, torch.zeros(1)])
