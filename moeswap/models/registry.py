"""GGUF architecture name -> the family module that builds it."""

from __future__ import annotations

from types import ModuleType

import moeswap.models.deepseek2 as deepseek2
import moeswap.models.gemma3 as gemma3
import moeswap.models.gemma4 as gemma4
import moeswap.models.glm4moe as glm4moe
import moeswap.models.gpt_oss as gpt_oss
import moeswap.models.granitemoe as granitemoe
import moeswap.models.llama as llama
import moeswap.models.llama4 as llama4
import moeswap.models.phimoe as phimoe
import moeswap.models.qwen2moe as qwen2moe
import moeswap.models.qwen3moe as qwen3moe
from moeswap.errors import MoeswapError

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
    "glm4moe": glm4moe,
    "phimoe": phimoe,
    "llama4": llama4,
}


def family(arch: str) -> ModuleType:
    if arch not in FAMILIES:
        raise MoeswapError(f"architecture '{arch}' is not supported "
                           f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[arch]
