"""GPT-OSS: sliding and global layers as layer_types says; the FFN's pre-norm is named
post_attention_norm in llama.cpp."""

from moeswap.formats.families.hooks import FamilyHooks

HOOKS = FamilyHooks(hf_layer_types=True,
                    hf_layer_norms={"post_attention_layernorm": "post_attention_norm"})
