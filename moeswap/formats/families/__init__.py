"""Each architecture's own reading of GGUF keys, HF config.json and HF tensor names.

``formats.config`` reads what every family shares and ``formats.hf_names`` holds the shared HF
name table; what one family adds (its checks, the scales llama.cpp hard-codes, per-layer-type
sizes, its own tensor names) is that family's ``FamilyHooks`` (``families.hooks``), in one
module per family here.
"""

from __future__ import annotations

import moeswap.formats.families.deepseek2 as deepseek2
import moeswap.formats.families.gemma3 as gemma3
import moeswap.formats.families.gemma4 as gemma4
import moeswap.formats.families.glm4moe as glm4moe
import moeswap.formats.families.gpt_oss as gpt_oss
import moeswap.formats.families.granitemoe as granitemoe
import moeswap.formats.families.llama as llama
import moeswap.formats.families.llama4 as llama4
import moeswap.formats.families.phimoe as phimoe
import moeswap.formats.families.qwen2moe as qwen2moe
import moeswap.formats.families.qwen3moe as qwen3moe
from moeswap.formats.families.hooks import FamilyHooks

# GGUF architecture -> its hooks; one entry per architecture in formats.config.ARCH_TRAITS.
FAMILIES: dict[str, FamilyHooks] = {
    "llama": llama.HOOKS,
    "qwen2moe": qwen2moe.HOOKS,
    "qwen3moe": qwen3moe.HOOKS,
    "olmoe": qwen3moe.HOOKS,  # reads its config as Qwen3-MoE does
    "granitemoe": granitemoe.HOOKS,
    "gemma3": gemma3.HOOKS,
    "deepseek2": deepseek2.HOOKS,
    "gpt-oss": gpt_oss.HOOKS,
    "gemma4": gemma4.HOOKS,
    "glm4moe": glm4moe.HOOKS,
    "phimoe": phimoe.HOOKS,
    "llama4": llama4.HOOKS,
}
