"""ggml's repacked CPU layouts for dense weights: rows interleaved for the running CPU's SIMD
kernels (x86: Q4_0, Q4_K, IQ4_NL, MXFP4 with AVX2; Q2_K with AVX-512; ARM: Q8_0 too), so a
product streams fewer, longer loads.

They live in the CPU backend's "extra" buffer type ``CPU_REPACK``, reachable only through
``ggml_backend_reg_get_proc_address(ggml_backend_cpu_reg(), "ggml_backend_dev_get_extra_bufts")``
(the direct symbol is a mangled C++ name). Its ``set_tensor`` repacks a whole tensor at offset 0
into memory ggml allocates, and it has no ``get_tensor``: it cannot bind mapped bytes, so a
repacked weight is a second copy, made at load, and the stored bytes are no longer read.
Whether a weight repacks (type, shape, CPU) is ggml's own decision, asked through
``ggml_backend_dev_supports_op`` on a product with the weight already placed in that buffer,
as llama.cpp asks; a weight it refuses stays in the plain layout.

A repacked product differs from the plain one in the last bits (another summation order), so
the plain layout stays where bits must agree across tiers (routed experts) and under
``exact`` (``--exact-tiers``).
"""

from __future__ import annotations

import ctypes
import functools
import sys

from moeswap.quant.ggml_lib import GGML, InitParams

_F32, _I32 = 0, 26  # GGML_TYPE_F32, GGML_TYPE_I32
_REPACK_NAME = b"CPU_REPACK"


# ggml_log_callback: void (*)(enum ggml_log_level level, const char * text, void * user_data)
_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_WARN, _CONT = 3, 5  # GGML_LOG_LEVEL_WARN (ERROR is 4), GGML_LOG_LEVEL_CONT


class _QuietLog:
    """ggml's log without its debug and info lines (the repack names every tensor it packs on
    stderr); warnings and errors still go to stderr."""

    def __init__(self):
        self.shown = False
        self.callback = _LOG_CALLBACK(self._log)  # kept: ggml holds only the pointer

    def _log(self, level: int, text: bytes, _user) -> None:
        self.shown = self.shown if level == _CONT else level >= _WARN
        if self.shown:
            sys.stderr.write(text.decode(errors="replace"))


@functools.lru_cache(maxsize=1)
def _quiet_log(ggml: GGML) -> _QuietLog:
    log = _QuietLog()
    ggml.ggml_log_set(ctypes.cast(log.callback, ctypes.c_void_p), None)
    return log


@functools.lru_cache(maxsize=1)
def _repack_buffer_type(ggml: GGML) -> tuple[int, int] | None:
    """(CPU device, the CPU_REPACK buffer type), or None where this ggml has none."""
    reg = ggml.ggml_backend_cpu_reg()
    address = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not address:
        return None
    device = ggml.ggml_backend_reg_dev_get(reg, 0)
    extra_bufts = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(address)(device)
    table = ctypes.cast(extra_bufts, ctypes.POINTER(ctypes.c_void_p))
    for i in range(16):  # a NULL-terminated array
        if not table[i]:
            break
        if ggml.ggml_backend_buft_name(table[i]) == _REPACK_NAME:
            return device, table[i]
    return None


def repacked_matrix(ggml: GGML, data, ggml_type: int, ne: tuple[int, ...]
                    ) -> tuple[int, int, int] | None:
    """A weight of GGUF shape ``ne = (in, out)``, or a stack ``(in, out, X)`` for
    ``mul_mat_id``, copied from ``data`` (its stored bytes, a uint8 numpy array) into ggml's
    repacked layout -> (context, tensor, buffer) for the caller to free, or None where ggml
    does not repack this type and shape on this CPU."""
    found = _repack_buffer_type(ggml)
    if found is None:
        return None
    device, buft = found
    _quiet_log(ggml)
    context = ggml.ggml_init(InitParams(4 * ggml.ggml_tensor_overhead(), None, True))
    tensor = (ggml.ggml_new_tensor_2d(context, ggml_type, *ne) if len(ne) == 2
              else ggml.ggml_new_tensor_3d(context, ggml_type, *ne))
    buffer = ggml.ggml_backend_buft_alloc_buffer(buft, ggml.ggml_backend_buft_get_alloc_size(
        buft, tensor))
    # placing it runs the buffer's init_tensor, which picks ggml's repack for the tensor (or none)
    status = ggml.ggml_backend_tensor_alloc(buffer, tensor, ggml.ggml_backend_buffer_get_base(buffer))
    if len(ne) == 2:
        probe = ggml.ggml_mul_mat(context, tensor, ggml.ggml_new_tensor_2d(context, _F32, ne[0], 1))
    else:  # one token picking one expert: (in, 1, 1) rows, (1, 1) ids
        probe = ggml.ggml_mul_mat_id(context, tensor,
                                     ggml.ggml_new_tensor_3d(context, _F32, ne[0], 1, 1),
                                     ggml.ggml_new_tensor_2d(context, _I32, 1, 1))
    if status != 0 or not ggml.ggml_backend_dev_supports_op(device, probe):
        ggml.ggml_backend_buffer_free(buffer)
        ggml.ggml_free(context)
        return None
    ggml.ggml_backend_tensor_set(tensor, data.ctypes.data, 0, data.nbytes)  # repacks
    return context, tensor, buffer
