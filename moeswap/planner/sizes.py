"""What a model costs in bytes, from a GGUF header alone: weights by role and the KV cache.

Weights come from the MoE view (``moeswap.formats.gguf_moe``: every tensor classified once);
the KV cache from ``ModelConfig.kv_floats_per_token`` (MLA's latent, Gemma 4's two layer
types), with sliding-window layers holding only their window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moeswap.experts.tiers import slot_bytes
from moeswap.formats.config import ModelConfig, config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_moe import EMBEDDING, ROUTED, MoEView
from moeswap.memory import HostCharge
from moeswap.models.quant_experts import ExpertLayout

F16_BYTES = 2  # llama.cpp's default cache type (-ctk f16 -ctv f16); vLLM and SGLang's bf16 too
LLAMA_CPP_UBATCH = 512  # llama.cpp's default micro-batch (-ub)


@dataclass(frozen=True)
class ModelSizes:
    path: str
    config: ModelConfig
    total_bytes: int  # every tensor
    shared_bytes: int  # everything but routed experts
    routed_bytes: int
    one_expert_bytes: int  # one routed expert of the largest MoE layer
    active_bytes_per_token: int  # shared weights a token reads + top-k experts of every MoE layer
    expert_bytes_by_layer: dict[int, int]  # one routed expert of each MoE layer
    expert_pieces_by_layer: dict[int, tuple[int, ...]]  # bytes of each piece the store reads
    layer_bytes: dict[int, int]  # every tensor of a block except its routed experts
    input_bytes: int  # token embedding tables: llama.cpp keeps them on the CPU
    output_bytes: int  # output norm and head (token_embd again when tied): the GPU's with -ngl all
    slot_bytes: int  # moeswap's expert slot: the largest expert, pieces 32-byte aligned
    shared_elements: int  # weights (numbers) outside the routed experts
    tensor_names: tuple[str, ...]

    @property
    def shared_bits_per_weight(self) -> float:
        return 8 * self.shared_bytes / self.shared_elements if self.shared_elements else 0.0

    @property
    def moe_layers(self) -> list[int]:
        return sorted(self.expert_bytes_by_layer)

    @property
    def n_expert(self) -> int:
        return self.config.n_expert

    @property
    def top_k(self) -> int:
        return self.config.n_expert_used

    @property
    def active_shared_bytes(self) -> int:
        """Bytes of non-expert weights one token reads."""
        return self.active_bytes_per_token - self.top_k * sum(self.expert_bytes_by_layer.values())

    def kv_bytes(self, context: int, value_bytes: int, sequences: int = 1,
                 swa_cells: int = 0) -> int:
        """The cache for ``sequences`` of ``context`` positions; sliding layers keep
        ``swa_cells`` of them (0: the window)."""
        full, swa = self.config.kv_floats_per_token_by_kind
        held = min(context, swa_cells or self.config.sliding_window or context)
        return sequences * value_bytes * (full * context + swa * held)

    def llama_cpp_swa_cells(self) -> int:
        """Cells llama.cpp's sliding-window cache keeps per sequence (llama_kv_cache_iswa
        without --swa-full): the window and one micro-batch, padded to 256. llama.cpp pads
        first and caps at the full cache after, min(size_base, GGML_PAD(n_swa + n_ubatch,
        n_pad)) (src/llama-kv-cache-iswa.cpp), as kv_bytes' min(context, cells) does."""
        window = self.config.sliding_window
        return -(-(window + LLAMA_CPP_UBATCH) // 256) * 256 if window else 0

    @property
    def staging_bytes(self) -> int:
        """The store's staging ring: one slot per pick of a token."""
        return max(self.top_k, 1) * self.slot_bytes

    def host_terms(self, charge: HostCharge) -> dict[str, int]:
        """What moeswap's expert store charges the host budget for ``charge``, term by term
        (float32 KV cache; sliding layers keep window - 1 + a step's positions)."""
        return charge.terms(self.config, self.shared_bytes, self.staging_bytes)

    def host_charged(self, charge: HostCharge) -> int:
        """The host bytes the store charges for ``charge`` before its first expert slot."""
        return charge.bytes(self.config, self.shared_bytes, self.staging_bytes)


def model_sizes(gf: GGUFFile) -> ModelSizes:
    """Byte counts of one GGUF file (header and tensor index only)."""
    config = config_from_gguf(gf)
    view = MoEView(gf, config.n_layer)
    totals = view.totals()
    moe = [layer for layer in view.layers if layer.is_moe]
    layer_bytes = {layer.index: sum(max(t.n_bytes, 0) for t in view.tensors
                                    if view.roles[t.name].layer == layer.index)
                   - layer.bytes_of(ROUTED) for layer in view.layers}
    embedding = sum(t.n_bytes for t in view.global_tensors.get(EMBEDDING, []))
    tied = gf.tensor("output.weight") is None
    tok_embd = gf.tensor("token_embd.weight")
    output = totals.shared - sum(layer_bytes.values()) - embedding
    if tied and tok_embd is not None:
        output += tok_embd.n_bytes  # llama.cpp loads the tied head a second time, on the output layer
    layouts = [ExpertLayout.from_file(gf, layer.index) for layer in moe]
    return ModelSizes(
        path=str(gf.path), config=config, total_bytes=totals.total, shared_bytes=totals.shared,
        routed_bytes=totals.routed, one_expert_bytes=totals.one_expert,
        active_bytes_per_token=totals.active_per_token,
        expert_bytes_by_layer={layer.index: view.expert_bytes(layer) for layer in moe},
        expert_pieces_by_layer={layout.layer: tuple(part.expert_bytes for part in layout.parts)
                                for layout in layouts},
        layer_bytes=layer_bytes, input_bytes=embedding, output_bytes=output,
        slot_bytes=slot_bytes(layouts),
        shared_elements=sum(math.prod(t.shape) for t in view.tensors
                            if view.roles[t.name].role != ROUTED),
        tensor_names=tuple(t.name for t in gf.tensors))
