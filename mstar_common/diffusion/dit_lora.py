"""`model_kwargs.lora`: LoRA adapters folded into a diffusion transformer's weights at load, so a styled deployment
runs at base speed.

An adapter is a safetensors file of low-rank pairs, `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight`
[out, r] (Kohya's `lora_down`/`lora_up` name the same pair; PEFT's `lora_A.default.weight` too), in any of the
layouts trainers write:

- diffusers/PEFT: the module named as in our transformer (diffusers' names), bare or behind `transformer.`
  (diffusers' `save_lora_weights`) or `base_model.model.` (PEFT);
- the model's original layout behind `diffusion_model.` (ai-toolkit, BFL): the family's transformer lists those
  names (`lora_aliases()`), each with the weights it covers; a fused projection (FLUX.2's `img_attn.qkv`) covers
  several, one chunk of lora_B's rows each, and a chunk order can be swapped (FLUX.2's final `adaLN_modulation`,
  whose scale and shift diffusers' checkpoint conversion swaps);
- Kohya's `lora_unet_<module>` with `_` for `.`, resolved against both name sets.

Scaling follows PEFT: alpha is the module's `<module>.alpha` tensor if the file has one, else `lora_alpha` from the
file's `lora_adapter_metadata` header (diffusers writes it), else from `adapter_config.json` (or `config.json`)
beside the file, else r; the factor is alpha/r, or alpha/sqrt(r) with `use_rslora`, times the entry's `scale`.

Each weight's deltas, `scale * factor * (B @ A)` of every adapter, are summed onto its fp32 copy and rounded to the
serving dtype once (`Fold`, applied by `load_module` before the cast, and so before `dit_fp8` quantizes).

Refused, naming the adapter and the rule: DoRA (`lora_magnitude_vector`, `dora_scale`: its magnitudes would be
dropped by a plain merge), LyCORIS LoKr/LoHa (`lokr_`, `hada_`), text-encoder keys, modules the transformer does
not have (a LoRA for another model), shapes that do not match, an A without its B, PEFT's per-module
`alpha_pattern`, a file safetensors cannot read (a Git LFS pointer) or a config that is not JSON, and a module
named twice (two spellings of one, or two layouts' names for one weight: one would be dropped or summed twice).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mstar_common.checkpoints import expand_home
from mstar_common.config import is_finite_number
from mstar_common.diffusion.diffusers_checkpoint import kernels_enabled, load_module
from mstar_common.diffusion.image_options import LoraAdapter
from mstar_common.safetensors_io import format_names, unreadable

logger = logging.getLogger(__name__)

_PREFIXES = ("transformer.", "base_model.model.", "diffusion_model.")
_KOHYA = "lora_unet_"
_PAIRS = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_down.weight": "A", ".lora_up.weight": "B",
          ".lora_A.default.weight": "A", ".lora_B.default.weight": "B"}
_DORA = ("lora_magnitude_vector", "dora_scale")
_LYCORIS = (".lokr_", ".hada_")
_CONFIGS = ("adapter_config.json", "config.json")

Target = tuple[str, int, tuple[int, ...]]  # (weight name, chunks of lora_B's rows, the chunks it takes, in order)


@dataclass(frozen=True, slots=True)
class _Term:
    down: torch.Tensor  # A [r, in], fp32
    up: torch.Tensor  # B [out, r], fp32
    factor: float  # scale * alpha / r (or / sqrt(r))


class Fold:
    """`load_module`'s `adjust`: a checkpoint tensor plus its LoRA deltas, summed in fp32 (the cast that follows is
    the one rounding). `terms` maps a weight name to its adapters' low-rank pairs."""

    def __init__(self, terms: dict[str, list[_Term]]) -> None:
        self.terms = terms

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        terms = self.terms.get(name)
        if not terms:
            return tensor
        merged = tensor.to(torch.float32, copy=True)
        for term in terms:
            merged.addmm_(term.up, term.down, alpha=term.factor)
        return merged


def load_dit(build: Callable[[], nn.Module], root: Path, dtype: str, device: str,
             lora: Sequence[LoraAdapter] = ()) -> Any:
    """A family's DiT from `root/transformer`, with the `lora` adapters folded into its weights (fp32 sums, rounded
    once to `dtype`). Every folded name is a weight of the module, which load_module's coverage check fills."""
    model = load_module(build, root / "transformer", "diffusion_pytorch_model", lambda _: False, dtype, device,
                        adjust=lora_fold(lora, build))
    model.use_fused_kernels(kernels_enabled(device))
    return model


def lora_fold(adapters: Sequence[LoraAdapter], build: Callable[[], nn.Module], *, check_only: bool = False
              ) -> Fold | None:
    """The fold of `adapters` onto the transformer `build` makes (its names and shapes); None without adapters.
    `check_only`: every rule checked from the files' headers and alpha scalars, no other tensor read (the fold's
    low-rank pairs are then meta tensors: for `mstar check` and start-up, before any weights load)."""
    if not adapters:
        return None
    layout = Layout.of(build)
    terms: dict[str, list[_Term]] = {}
    for adapter in adapters:
        for name, adapter_terms in read_adapter(adapter, layout, check_only=check_only).items():
            terms.setdefault(name, []).extend(adapter_terms)
    if not check_only:
        logger.info("lora: %d adapter(s) fold into %d weights", len(adapters), len(terms))
    return Fold(terms)


class Layout:
    """The names a LoRA file may give the transformer's modules -> the weights each covers: our (diffusers') names,
    the family's original-layout aliases (`lora_aliases()` of the transformer), and Kohya's spelling of both."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], aliases: dict[str, tuple[Target, ...]]) -> None:
        self.shapes = shapes
        self.targets: dict[str, tuple[Target, ...]] = dict(aliases)
        self.targets.update({name.removesuffix(".weight"): ((name, 1, (0,)),) for name in shapes
                             if name.endswith(".weight")})
        kohya: dict[str, str | None] = {}
        for module in self.targets:
            spelled = module.replace(".", "_")
            kohya[spelled] = module if kohya.get(spelled, module) == module else None  # None: ambiguous
        self.kohya = kohya

    @classmethod
    def of(cls, build: Callable[[], nn.Module]) -> Layout:
        with torch.device("meta"):  # no memory, no init
            module = build()
        aliases = module.lora_aliases() if hasattr(module, "lora_aliases") else {}
        return cls({name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}, aliases)

    def module(self, key: str) -> str:
        """A file's module name (prefixes stripped) -> the name `targets` knows it by (unchanged if unknown)."""
        if key.startswith(_KOHYA):
            return self.kohya.get(key.removeprefix(_KOHYA)) or key
        return key


def adapter_file(path: str) -> Path:
    """The adapter's safetensors: `path` itself, or the one .safetensors file in the folder `path`."""
    file = expand_home(path)
    if file.is_dir():
        found = sorted(file.glob("*.safetensors"))
        if len(found) != 1:
            raise ValueError(f"LoRA {path}: a folder must hold exactly one .safetensors file, found {len(found)}")
        return found[0]
    if file.suffix != ".safetensors":
        raise ValueError(f"LoRA {path}: not a .safetensors file (diffusers/PEFT adapters are saved as safetensors)")
    return file


def read_adapter(adapter: LoraAdapter, layout: Layout, *, check_only: bool = False) -> dict[str, list[_Term]]:
    """One adapter's low-rank pairs per weight name of the transformer, each with its scaling factor (`check_only`:
    the pairs as meta tensors of the file's shapes)."""
    file = adapter_file(adapter.path)
    where = f"LoRA {adapter.path}"
    try:
        with safe_open(str(file), framework="pt") as reader:
            tensors = {key: _meta(reader, key) if check_only and not key.endswith(".alpha") else reader.get_tensor(key)
                       for key in reader.keys()}  # noqa: SIM118 - safe_open has no iter
            header = reader.metadata() or {}
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors' own error type (a Git LFS pointer, a cut download)
        raise ValueError(f"{where}: {unreadable(file, exc)}") from None
    pairs, alphas = _split_keys(tensors, layout, where)
    unknown = sorted(module for module in pairs if module not in layout.targets)
    if unknown:
        raise ValueError(f"{where}: {len(unknown)} module(s) this transformer does not have, e.g. "
                         f"{format_names(unknown)}: a LoRA for another model?")
    config = _scaling_config(file, header, where)
    terms: dict[str, list[_Term]] = {}
    covered: dict[str, str] = {}  # weight -> the module of this file that changes it
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has only lora_{next(iter(pair))}; a LoRA module needs both lora_A "
                             f"and lora_B")
        down, up = pair["A"].float(), pair["B"].float()
        rank = down.shape[0]
        alpha = float(alphas[module]) if module in alphas else config.get("lora_alpha", rank)
        factor = adapter.scale * alpha / (math.sqrt(rank) if config.get("use_rslora", False) else rank)
        for name, chunks, order in layout.targets[module]:
            if covered.setdefault(name, module) != module:  # e.g. `attention.out` beside `attention.to_out.0`
                raise ValueError(f"{where}: {covered[name]} and {module} both change {name} (two layouts' names "
                                 f"for one weight); keep one")
            shape = layout.shapes[name]
            if down.ndim != 2 or up.ndim != 2 or up.shape[1] != rank or up.shape[0] % chunks:
                raise ValueError(f"{where}: {module}: lora_B {tuple(up.shape)} @ lora_A {tuple(down.shape)} is not a "
                                 f"low-rank pair of {chunks} equal row chunk(s)")
            part = torch.cat([up.chunk(chunks)[i] for i in order]) if chunks > 1 else up
            if (part.shape[0], down.shape[1]) != shape:
                raise ValueError(f"{where}: {module}: lora_B {tuple(part.shape)} @ lora_A {tuple(down.shape)} does "
                                 f"not make the weight's shape {tuple(shape)}")
            terms.setdefault(name, []).append(_Term(down, part.contiguous(), factor))
    if not terms:
        raise ValueError(f"{where}: no lora_A/lora_B weights for the transformer in it")
    return terms


def _meta(reader: Any, key: str) -> torch.Tensor:
    """A tensor of the file's shape for `key`, read from its header alone."""
    return torch.empty(reader.get_slice(key).get_shape(), device="meta")


def check_adapters(adapters: Sequence[LoraAdapter], build: Callable[[], nn.Module]) -> None:
    """Every rule `lora_fold` applies, from the adapters' headers: a bad adapter is refused before weights load."""
    lora_fold(adapters, build, check_only=True)


def _split_keys(tensors: dict[str, torch.Tensor], layout: Layout, where: str) -> tuple[
        dict[str, dict[str, torch.Tensor]], dict[str, float]]:
    """Keys -> ({module: {"A": A, "B": B}}, {module: alpha}), modules named as `layout.targets` knows them, refusing
    every key that is not one of those."""
    if dora := sorted(key for key in tensors if any(mark in key for mark in _DORA)):
        raise ValueError(f"{where}: a DoRA adapter ({format_names(dora)}): its magnitudes cannot be folded as a "
                         f"plain LoRA merge; only LoRA adapters are served")
    if lycoris := sorted(key for key in tensors if any(mark in key for mark in _LYCORIS)):
        raise ValueError(f"{where}: a LyCORIS LoKr/LoHa adapter ({format_names(lycoris)}): only LoRA's lora_A/lora_B "
                         f"pairs are folded")
    if text := sorted(key for key in tensors if key.startswith(("text_encoder", "lora_te"))):
        raise ValueError(f"{where}: text-encoder LoRA keys ({format_names(text)}): only the transformer's are "
                         f"folded; save the adapter without them")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    alphas: dict[str, float] = {}
    seen: dict[tuple[str, str], str] = {}  # (module, A | B | alpha) -> the key that gave it
    odd = []
    for key, tensor in tensors.items():
        name = key
        while prefix := next((p for p in _PREFIXES if name.startswith(p)), None):
            name = name.removeprefix(prefix)
        suffix = next((s for s in _PAIRS if name.endswith(s)), None)
        if suffix is not None:
            module, part = layout.module(name.removesuffix(suffix)), _PAIRS[suffix]
        elif name.endswith(".alpha") and tensor.numel() == 1:
            module, part = layout.module(name.removesuffix(".alpha")), "alpha"
        else:
            odd.append(key)
            continue
        if (module, part) in seen:  # two spellings of one module: one would silently replace the other
            raise ValueError(f"{where}: {seen[module, part]} and {key} both name {module}'s "
                             f"{'alpha' if part == 'alpha' else 'lora_' + part}; keep one")
        seen[module, part] = key
        if part == "alpha":
            alphas[module] = tensor.item()
        else:
            pairs.setdefault(module, {})[part] = tensor
    if odd:
        raise ValueError(f"{where}: keys that are not LoRA lora_A/lora_B/alpha weights: {format_names(sorted(odd))}")
    if stray := sorted(set(alphas) - set(pairs)):
        raise ValueError(f"{where}: alpha for modules without lora_A/lora_B: {format_names(stray)}")
    return pairs, alphas


def _scaling_config(file: Path, header: dict[str, str], where: str) -> dict:
    """`lora_alpha`/`use_rslora`: from the file's `lora_adapter_metadata` header, else the first config beside it."""
    config: dict = {}
    source = f"{file}'s lora_adapter_metadata header"
    if raw := header.get("lora_adapter_metadata"):
        try:
            meta = json.loads(raw)  # diffusers' pipeline save prefixes the keys with the component
        except ValueError as exc:
            raise ValueError(f"{where}: {source} is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: {source} is not a JSON object")
        config = {key.removeprefix("transformer."): value for key, value in meta.items()}
    else:
        for name in _CONFIGS:
            if (file.parent / name).is_file():
                source = str(file.parent / name)
                try:
                    config = json.loads((file.parent / name).read_text())
                except ValueError as exc:
                    raise ValueError(f"{where}: {source} is not JSON: {exc}") from None
                if not isinstance(config, dict):
                    raise ValueError(f"{where}: {source} is not a JSON object")
                break
    # read into the scaling factor: a string alpha or use_rslora was a TypeError, or (a "false") rsLoRA on
    if "lora_alpha" in config and not is_finite_number(config["lora_alpha"]):
        raise ValueError(f"{where}: {source}: lora_alpha must be a number, got {config['lora_alpha']!r}")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ValueError(f"{where}: {source}: use_rslora must be true or false, got {config['use_rslora']!r}")
    if config.get("alpha_pattern"):
        raise ValueError(f"{where}: per-module alpha_pattern {config['alpha_pattern']} is not supported; merge it "
                         f"into per-module `<module>.alpha` tensors")
    return config
