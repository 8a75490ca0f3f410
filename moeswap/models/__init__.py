"""The engine: models of every family over lazy weights, and the loader that builds them."""

from moeswap.models.blocks import KVCache
from moeswap.models.causal_lm import CausalLM
from moeswap.models.loader import load_model

__all__ = ["CausalLM", "KVCache", "load_model"]
