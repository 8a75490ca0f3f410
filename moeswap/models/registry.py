"""GGUF architecture name -> the family module that builds it."""

from __future__ import annotations

from types import ModuleType

from moeswap.errors import MoeswapError
from moeswap.models import deepseek2, gemma3, gemma4, gpt_oss, granitemoe, llama, qwen2moe, qwen3moe

FAMILIES: dict[str, ModuleType] = {
    "llama": llama,
    "qwen2moe": qwen2moe,
    "qwen3moe": qwen3moe,
    "olmoe": qwen3moe,  # same layer structure; the config says how q/k norms and weights differ
    "granitemoe": granitemoe,
    "gemma3": gemma3,
    "deepseek2": deepseek2,
    "gpt-oss": gpt_oss,
    "gemma4": gemma4,
}


def family(arch: str) -> ModuleType:
    if arch not in FAMILIES:
        raise MoeswapError(f"architecture '{arch}' is not supported "
                           f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[arch]
