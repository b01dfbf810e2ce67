"""The explicit family registry: YAML `family:` -> Family class. No import-time discovery."""

from __future__ import annotations

from mstar_common.families.base import Family


def _families() -> dict[str, type[Family]]:
    from mstar_common.families.flux2_klein.family import Flux2KleinFamily
    from mstar_common.families.llama.family import LlamaFamily
    from mstar_common.families.orpheus.family import OrpheusFamily
    from mstar_common.families.qwen3.family import Qwen3Family
    from mstar_common.families.whisper.family import WhisperFamily
    from mstar_common.families.z_image_turbo.family import ZImageTurboFamily

    return {Qwen3Family.name: Qwen3Family, OrpheusFamily.name: OrpheusFamily, Flux2KleinFamily.name: Flux2KleinFamily,
            WhisperFamily.name: WhisperFamily, LlamaFamily.name: LlamaFamily, ZImageTurboFamily.name: ZImageTurboFamily}


def get_family(name: str) -> Family:
    families = _families()
    if name not in families:
        raise KeyError(f"unknown family {name!r}; available: {sorted(families)}")
    return families[name]()


def family_names() -> list[str]:
    return sorted(_families())
