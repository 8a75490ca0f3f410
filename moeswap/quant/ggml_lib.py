"""The ggml C functions moeswap calls, bound with ctypes from llama-cpp-python's own ggml.

llama-cpp-python ships ggml as shared libraries (``llama_cpp/lib/libggml-base``,
``libggml-cpu``) built for the installing machine's CPU. Binding those, instead of building a
second ggml, gives our quantized products exactly llama.cpp's kernels (see docs/KERNELS.md).

Only stable, opaque-pointer API is declared here: the one struct we lay out ourselves is
``ggml_init_params`` (unchanged since ggml's first release); the thread-pool parameters are
filled by ggml itself into a buffer we never read. Every return type is declared, so no
pointer is truncated to a C int.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
from pathlib import Path

from moeswap.errors import MoeswapError

_VOID_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_SIZE = ctypes.c_size_t
_INT = ctypes.c_int
_BOOL = ctypes.c_bool

# Room for ggml_threadpool_params (cpumask[GGML_MAX_N_THREADS=512] + 4 ints/bools: 528 bytes
# today), filled by ggml_threadpool_params_init and only passed back by pointer.
THREADPOOL_PARAMS_BYTES = 4096


class InitParams(ctypes.Structure):
    """struct ggml_init_params."""

    _fields_ = [("mem_size", _SIZE), ("mem_buffer", _VOID_P), ("no_alloc", _BOOL)]


# name -> (return type, argument types); looked up in libggml-base, then libggml-cpu, since
# functions have moved between the two across ggml versions.
_SIGNATURES = {
    "ggml_init": (_VOID_P, [InitParams]),
    "ggml_free": (None, [_VOID_P]),
    "ggml_tensor_overhead": (_SIZE, []),
    "ggml_graph_overhead_custom": (_SIZE, [_SIZE, _BOOL]),
    "ggml_new_tensor_2d": (_VOID_P, [_VOID_P, _INT, _I64, _I64]),
    "ggml_new_tensor_3d": (_VOID_P, [_VOID_P, _INT, _I64, _I64, _I64]),
    "ggml_mul_mat": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_mul_mat_id": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P, _VOID_P]),
    # The fused MoE feed-forward graph (moeswap/quant/moe_graph.py): views, rows, element-wise.
    "ggml_new_tensor_1d": (_VOID_P, [_VOID_P, _INT, _I64]),
    "ggml_view_1d": (_VOID_P, [_VOID_P, _VOID_P, _I64, _SIZE]),
    "ggml_view_2d": (_VOID_P, [_VOID_P, _VOID_P, _I64, _I64, _SIZE, _SIZE]),
    "ggml_view_3d": (_VOID_P, [_VOID_P, _VOID_P, _I64, _I64, _I64, _SIZE, _SIZE, _SIZE]),
    "ggml_reshape_3d": (_VOID_P, [_VOID_P, _VOID_P, _I64, _I64, _I64]),
    "ggml_get_rows": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_add": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_mul": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_swiglu_split": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_tanh": (_VOID_P, [_VOID_P, _VOID_P]),
    "ggml_silu": (_VOID_P, [_VOID_P, _VOID_P]),
    "ggml_gelu": (_VOID_P, [_VOID_P, _VOID_P]),  # llama.cpp's GELU (an f16 table on the CPU)
    "ggml_scale": (_VOID_P, [_VOID_P, _VOID_P, ctypes.c_float]),
    "ggml_scale_bias": (_VOID_P, [_VOID_P, _VOID_P, ctypes.c_float, ctypes.c_float]),
    "ggml_swiglu_oai": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P, ctypes.c_float, ctypes.c_float]),
    "ggml_backend_view_init": (_INT, [_VOID_P]),
    # Q8_0 experts (moeswap/quant/q8_0_kernel.py): a custom op.
    "ggml_custom_4d": (_VOID_P, [_VOID_P, _INT, _I64, _I64, _I64, _I64, _VOID_P, _INT, _VOID_P,
                                 _INT, _VOID_P]),
    "ggml_get_data": (_VOID_P, [_VOID_P]),
    "ggml_nelements": (_I64, [_VOID_P]),
    # Attention as one graph per layer (moeswap/models/ggml_attention.py).
    "ggml_reshape_2d": (_VOID_P, [_VOID_P, _VOID_P, _I64, _I64]),
    "ggml_permute": (_VOID_P, [_VOID_P, _VOID_P, _INT, _INT, _INT, _INT]),
    "ggml_cont": (_VOID_P, [_VOID_P, _VOID_P]),
    "ggml_repeat": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_rms_norm": (_VOID_P, [_VOID_P, _VOID_P, ctypes.c_float]),
    "ggml_rope_ext": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P, _VOID_P, _INT, _INT, _INT,
                                ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float,
                                ctypes.c_float, ctypes.c_float]),
    "ggml_soft_max_ext": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P, ctypes.c_float, ctypes.c_float]),
    "ggml_set_rows": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P, _VOID_P]),
    # A Q8_0 KV cache's attention (--kv-type q8_0), as llama.cpp's flash branch.
    "ggml_flash_attn_ext": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P, _VOID_P, _VOID_P,
                                      ctypes.c_float, ctypes.c_float, ctypes.c_float]),
    "ggml_prec_set_acc": (_BOOL, [_VOID_P, _INT]),
    "ggml_cpy": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    # Routing in the layer graph (llama.cpp's build_moe_ffn, softmax gating).
    "ggml_soft_max": (_VOID_P, [_VOID_P, _VOID_P]),
    "ggml_argsort": (_VOID_P, [_VOID_P, _VOID_P, _INT]),
    "ggml_sum_rows": (_VOID_P, [_VOID_P, _VOID_P]),
    "ggml_div": (_VOID_P, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_clamp": (_VOID_P, [_VOID_P, _VOID_P, ctypes.c_float, ctypes.c_float]),
    # ggml's repacked CPU layouts (moeswap/quant/repack.py): the CPU backend's extra buffer types.
    "ggml_backend_cpu_reg": (_VOID_P, []),
    "ggml_backend_reg_get_proc_address": (_VOID_P, [_VOID_P, ctypes.c_char_p]),
    "ggml_backend_reg_dev_get": (_VOID_P, [_VOID_P, _SIZE]),
    "ggml_backend_dev_supports_op": (_BOOL, [_VOID_P, _VOID_P]),
    "ggml_backend_buft_name": (ctypes.c_char_p, [_VOID_P]),
    "ggml_backend_buft_alloc_buffer": (_VOID_P, [_VOID_P, _SIZE]),
    "ggml_backend_buft_get_alloc_size": (_SIZE, [_VOID_P, _VOID_P]),
    "ggml_backend_buffer_get_base": (_VOID_P, [_VOID_P]),
    "ggml_backend_tensor_set": (None, [_VOID_P, _VOID_P, _SIZE, _SIZE]),
    "ggml_log_set": (None, [_VOID_P, _VOID_P]),
    "ggml_cpu_has_avx2": (_INT, []),
    "ggml_new_graph_custom": (_VOID_P, [_VOID_P, _SIZE, _BOOL]),
    "ggml_build_forward_expand": (None, [_VOID_P, _VOID_P]),
    "ggml_nbytes": (_SIZE, [_VOID_P]),
    "ggml_quantize_chunk": (_SIZE, [_INT, _VOID_P, _VOID_P, _I64, _I64, _I64, _VOID_P]),
    "ggml_quantize_requires_imatrix": (_BOOL, [_INT]),
    "ggml_backend_cpu_buffer_from_ptr": (_VOID_P, [_VOID_P, _SIZE]),
    "ggml_backend_tensor_alloc": (_INT, [_VOID_P, _VOID_P, _VOID_P]),
    "ggml_backend_buffer_free": (None, [_VOID_P]),
    "ggml_backend_graph_compute": (_INT, [_VOID_P, _VOID_P]),
    "ggml_backend_free": (None, [_VOID_P]),
    "ggml_threadpool_params_init": (None, [_VOID_P, _INT]),
    "ggml_backend_cpu_init": (_VOID_P, []),
    "ggml_backend_cpu_set_n_threads": (None, [_VOID_P, _INT]),
    "ggml_backend_cpu_set_threadpool": (None, [_VOID_P, _VOID_P]),
    "ggml_threadpool_new": (_VOID_P, [_VOID_P]),
    "ggml_threadpool_free": (None, [_VOID_P]),
}


class GGML:
    """The loaded libraries, with every function in ``_SIGNATURES`` as an attribute."""

    def __init__(self, lib_dir: Path):
        libraries = [ctypes.CDLL(str(_library_file(lib_dir, stem)), mode=ctypes.RTLD_GLOBAL)
                     for stem in ("libggml-base", "libggml-cpu")]
        self.lib_dir = lib_dir
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = next((getattr(library, name) for library in libraries
                             if hasattr(library, name)), None)
            if function is None:
                raise MoeswapError(f"{lib_dir}: this llama-cpp-python's ggml lacks {name}; "
                                   f"upgrade it with `pip install -U llama-cpp-python`")
            function.restype = restype
            function.argtypes = argtypes
            setattr(self, name, function)
        version = getattr(libraries[0], "ggml_version", None)  # absent from older ggml
        if version is not None:
            version.restype = ctypes.c_char_p
        self.version = version().decode() if version is not None else "unknown"


def _library_file(lib_dir: Path, stem: str) -> Path:
    """The file named by the library's soname, the one libllama's DT_NEEDED resolves to.

    The wheel holds libggml-base.so, .so.0 and .so.0.25.3 as three copies, not links; loading
    the soname file makes the dynamic loader share one copy with llama_cpp when both are used.
    """
    names = ([f"{stem}.0.dylib", f"{stem}.dylib"] if sys.platform == "darwin"
             else [f"{stem}.so.0", f"{stem}.so"])
    for name in names:
        if (lib_dir / name).exists():
            return lib_dir / name
    raise MoeswapError(
        f"{lib_dir / names[-1]}: llama-cpp-python's ggml library is missing (built with "
        f"GGML_BACKEND_DL?); reinstall it with `pip install --force-reinstall --no-cache-dir "
        f"llama-cpp-python`")


@functools.lru_cache(maxsize=1)
def load_ggml() -> GGML:
    """Load ggml once per process (the dynamic loader keeps a single copy anyway)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise MoeswapError("quantized CPU kernels need llama-cpp-python; install it with "
                           "`pip install llama-cpp-python` (it builds ggml for this CPU)")
    return GGML(Path(spec.origin).parent / "lib")
