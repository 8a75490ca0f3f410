"""load_model: a .gguf file or a HF folder -> a ready CausalLM with its expert runner.

In a GGUF file every matrix not stored as F32 is computed by ggml's kernels straight from the
mapped bytes (``BoundWeights``); F32 tensors are zero-copy views of the mapped file and go
through torch, as do HF folders, except where a layer graph binds them (attention, dense FFNs)
and a folder's MXFP4 experts (GPT-OSS as published), which ggml computes from their bytes
repacked as a GGUF holds them. A GGUF's routed experts, F32 ones too, are always ggml's
(``QuantResidentExperts``, ``mul_mat_id`` over the mapped stacks, as llama.cpp computes them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from moeswap.errors import MoeswapError
from moeswap.formats.config import config_from_gguf
from moeswap.formats.gguf_file import GGUFFile
from moeswap.formats.gguf_in_ram import copy_into_ram
from moeswap.formats.gguf_weights import GGUFWeights
from moeswap.formats.safetensors_weights import SafetensorsWeights
from moeswap.formats.tensor_shapes import check_shapes
from moeswap.formats.validation import refuse_invalid
from moeswap.models.blocks import KV_Q8_0
from moeswap.models.causal_lm import CausalLM
from moeswap.models.embedding_graph import EmbeddingGraph
from moeswap.models.experts import ResidentExperts
from moeswap.models import ggml_attention, ggml_ffn, head_graph, token_graph
from moeswap.models.graph_support import refuse_q8_0_cache
from moeswap.models.moe import DecisionRecorder, ExpertRunner
from moeswap.models.quant_experts import ExpertLayout, FolderMxfp4Experts, QuantResidentExperts
from moeswap.models.registry import family
from moeswap.models.weight_binding import BoundWeights
from moeswap.quant import CpuKernels


# Builds the routed-expert runner of a GGUF model: (file, kernels, MoE layers, activation) -> runner.
ExpertRunnerFactory = Callable[[GGUFFile, CpuKernels, list[int], str], ExpertRunner]

# --kv-type -> the torch type KVCache stores (the same names as moeswap.memory.KV_TYPES);
# KV_Q8_0: bytes of Q8_0 blocks, for the ggml attention graphs.
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "q8_0": KV_Q8_0}


def load_model(path: str | Path, *, verbose_log: Callable[[str], None] | None = None,
               threads: int | None = None, expert_runner: ExpertRunnerFactory | None = None,
               recorder: DecisionRecorder | None = None, replay: Any = None,
               context_tokens: int = 0, step_tokens: int = 0, kv_type: str = "f32",
               validate: bool = True, repack: bool = False,
               graphs: bool = True, in_ram: bool = False) -> CausalLM:
    """Open a .gguf file or a HF folder (config.json + *.safetensors) and build its model.

    threads: the kernels' thread count (default: every core this process may use).
    expert_runner: what computes a GGUF model's routed experts (default: all resident, computed
    from the mapped file); the offload store comes in here.
    recorder: handed every routing decision (moeswap.routing.recorder.RoutingRecorder).
    replay: a moeswap.routing.replay.RoutingReplay whose trace's decisions replace the router's.
    context_tokens, step_tokens: the positions of a sequence and the most tokens a forward feeds
    it, as a budget charged them (moeswap.memory.HostCharge): new KV caches are sized to them
    (0: caches grow as they fill).
    kv_type: of the KV caches' keys and values, 'f32' (the default: the reference tests compare
    against transformers in float32), 'f16' (the command line's default, as llama.cpp's) or
    'q8_0' (GGUF families whose attention runs as ggml graphs, heads of 32k numbers).
    validate: refuse a GGUF file with an error moeswap doctor reports (formats.validation);
    False is --force.
    repack: dense quantized matrices in ggml's repacked CPU layouts where it has one
    (moeswap.quant.repack: a copy in RAM, products off the plain layout's in the last bits);
    False (the library's default; the command line's is True) keeps the plain layouts,
    --exact-tiers.
    graphs: a GGUF layer's attention with its norms (moeswap.models.ggml_attention) and its
    dense feed-forwards (moeswap.models.ggml_ffn) as ggml graphs; False keeps the torch
    reference path.
    in_ram: a resident GGUF model's data copied into anonymous memory with transparent huge
    pages before anything binds it (moeswap.formats.gguf_in_ram); ignored with an expert
    runner, whose store reads the file itself.
    Any other failure while building is one MoeswapError naming the file and the tensor last
    bound, never a traceback.
    """
    path = Path(path)
    last = _LastTensor(verbose_log)
    try:
        return _load_model(path, last, threads, expert_runner, recorder, replay, context_tokens,
                           step_tokens, kv_type, validate, repack, graphs, in_ram)
    except MoeswapError:
        raise
    except Exception as e:  # a damaged file must end in one line, not a traceback
        raise MoeswapError(f"{path}: cannot load the model{last.where()}: "
                           f"{type(e).__name__}: {e}") from e


class _LastTensor:
    """The tensor log, remembering the tensor last bound (the first word of its line)."""

    def __init__(self, log: Callable[[str], None] | None):
        self.log, self.name = log, None

    def __call__(self, line: str) -> None:
        self.name = line.split(maxsplit=1)[0]
        if self.log is not None:
            self.log(line)

    def where(self) -> str:
        return f" (at tensor '{self.name}')" if self.name else ""


def _load_model(path: Path, verbose_log: Callable[[str], None], threads: int | None,
                expert_runner: ExpertRunnerFactory | None, recorder: DecisionRecorder | None,
                replay: Any, context_tokens: int, step_tokens: int, kv_type: str,
                validate: bool, repack: bool, graphs: bool, in_ram: bool) -> CausalLM:
    if kv_type not in KV_DTYPES:
        raise MoeswapError(f"unknown KV cache type {kv_type!r}; use one of {', '.join(KV_DTYPES)}")
    source: Any
    gguf: GGUFFile | None = None
    if path.is_dir():
        weights: Any = SafetensorsWeights(path)
        config, source = weights.config, path
    elif path.exists():
        source = gguf = GGUFFile.open(path)
        if in_ram and expert_runner is None:
            copy_into_ram(gguf)
        if validate:
            refuse_invalid(gguf)
        config = config_from_gguf(source)
        weights = GGUFWeights(source)
    else:
        raise MoeswapError(f"{path}: no such file or folder")
    if gguf is not None:
        check_shapes(str(path), config, (t.name for t in gguf.tensors),
                     lambda name: tuple(reversed(gguf.tensor(name).shape)))
    else:
        check_shapes(str(path), config, weights.names(), weights.tensor_shape)
    if expert_runner is not None and gguf is None:
        raise MoeswapError(f"{path}: expert offload (--host-mem / --device-mem) needs a .gguf file; "
                           f"convert the folder first: moeswap convert {path} -o MODEL.gguf")
    build = family(config.arch).build
    moe_layers = config.moe_layers
    mxfp4_folder = gguf is None and any(
        weights.is_mxfp4(f"blk.{i}.ffn_down_exps.weight") for i in moe_layers)
    kernels = CpuKernels(threads, repack) if gguf is not None or mxfp4_folder else None
    # with the offload store the shared weights leave the mapped file (BoundWeights, anonymous)
    bound = BoundWeights(weights, gguf, kernels, verbose_log, anonymous=expert_runner is not None)
    experts: Any
    if mxfp4_folder:
        experts = FolderMxfp4Experts(weights, kernels, moe_layers, config.expert_act)
    elif gguf is not None:
        experts = (expert_runner or QuantResidentExperts)(gguf, kernels, moe_layers, config.expert_act)
        if verbose_log is not None:
            _log_expert_stacks(gguf, moe_layers, verbose_log, offloaded=expert_runner is not None)
    else:
        experts = ResidentExperts.from_weights(bound, moe_layers, config.expert_act)
    if replay is not None:
        experts, recorder = replay.attach(config, str(path), experts, recorder)
    model = build(config, source, bound, experts, recorder)
    if graphs and kernels is not None:
        ggml_ffn.attach(model.layers, kernels)  # first: a layer graph takes in its FFN's
        ggml_attention.attach(model.layers, kernels)
        model.embedding = EmbeddingGraph(kernels, model.embedding)
        model.head_graph = head_graph.attach(model, kernels)
        model.token_graph = token_graph.attach(model, kernels)
    model.context, model.step_tokens = context_tokens, step_tokens
    model.weights_in_ram = gguf is not None and in_ram and expert_runner is None
    model.kv_dtype = KV_DTYPES[kv_type]
    if kv_type == "q8_0":
        _refuse_q8_0_cache(path, config.arch, model, graphs and kernels is not None)
    return model


def _refuse_q8_0_cache(path: Path, arch: str, model: CausalLM, graphs: bool) -> None:
    if not graphs:
        without = "a Hugging Face folder" if path.is_dir() else "load_model(graphs=False)"
        raise MoeswapError(f"{path}: --kv-type q8_0 is read only by ggml's attention graphs, "
                           f"which {without} does not use; use --kv-type f16")
    refuse_q8_0_cache(path, arch, model.layers)


def _log_expert_stacks(gguf: GGUFFile, layers: list[int], log: Callable[[str], None],
                       offloaded: bool) -> None:
    """The routed-expert stacks the kernels compute from where they lie, in the tensor log's form."""
    where = "expert store (tiers)" if offloaded else "mapped file (zero-copy, ggml kernels)"
    for layer in layers:
        for part in ExpertLayout.from_file(gguf, layer).parts:
            info = gguf.tensor(part.name)
            shape = "x".join(str(n) for n in info.shape)
            piece = f" of {gguf.piece_of(info).path.name}" if gguf.pieces else ""
            log(f"{info.name}  {shape}  {info.type_name}  {where}  "
                f"from offset {info.data_start}{piece}")

