"""Where a graph's tensors live: one after the other in the kernels' scratch work region.

Graphs run one at a time (``CpuKernels.run`` holds a lock), so every graph starts its arena at
the region's start: a graph's intermediate tensors live only while it computes.
"""

from __future__ import annotations

from moeswap.errors import MoeswapError
from moeswap.quant.ggml_lib import InitParams
from moeswap.quant.kernels import REGION_BYTES, WORK_OFFSET, CpuKernels, check_status

_ALIGNMENT = 64  # a cache line: ggml's SIMD loads never straddle two tensors' data


class Arena:
    """Places a graph's tensors one after the other in the scratch's work region."""

    def __init__(self, kernels: CpuKernels, context: int):
        self.kernels, self.ggml, self.context, self.used = kernels, kernels.ggml, context, 0
        self.offsets: dict[int, int] = {}  # tensor -> its scratch offset

    def place(self, tensor: int) -> int:
        """Give ``tensor`` the next free bytes -> its scratch offset."""
        n_bytes = self.ggml.ggml_nbytes(tensor)
        offset = WORK_OFFSET + self.used
        self.used += -(-n_bytes // _ALIGNMENT) * _ALIGNMENT
        if self.used > REGION_BYTES:  # checked here: ggml would write past the region
            raise MoeswapError(f"a graph needs over {REGION_BYTES} bytes of scratch; "
                               "run fewer tokens per step (--step-tokens)")
        self.kernels.place_in_scratch(tensor, offset)
        self.offsets[tensor] = offset
        return offset

    def new(self, ggml_type: int, *ne: int) -> int:
        """A new tensor of shape ``ne`` in the arena."""
        tensor = self.ggml.ggml_new_tensor_3d(self.context, ggml_type, *ne, *([1] * (3 - len(ne))))
        self.place(tensor)
        return tensor

    def op(self, tensor: int) -> int:
        """An op's result, placed."""
        self.place(tensor)
        return tensor

    def view(self, tensor: int) -> int:
        """A view (of a placed tensor), its data pointer set."""
        check_status(self.ggml.ggml_backend_view_init(tensor), "view")
        return tensor


def new_context(ggml, n_nodes: int) -> int:
    """A ggml context for a graph of at most n_nodes tensors and nodes (no data: an arena
    places them)."""
    size = n_nodes * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead_custom(n_nodes, False)
    return ggml.ggml_init(InitParams(size, None, True))


def free_contexts(ggml, contexts: list[int]) -> None:
    """Free the ggml contexts a graph's owner made (its finalizer)."""
    for context in contexts:
        ggml.ggml_free(context)
