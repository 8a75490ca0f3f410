"""Llama, Mixtral, Mistral (and Granite): llama.cpp's converter permutes their Q/K rows."""

from moeswap.formats.families.hooks import FamilyHooks

HOOKS = FamilyHooks(hf_qk_permuted=True)
