"""Who owns the cores during a forward step: ggml alone in decode, torch and ggml in turn in
prefill.

torch and ggml open their parallel regions on one OpenMP runtime in this process (torch's
``torch/lib/libgomp.so.1`` is loaded first, and ggml-cpu's ``libgomp.so.1`` dependency resolves
to it), so they share one team of threads, and every region is a fork and a join that the whole
step waits on; on a machine whose cores are busy, a descheduled worker makes each join wait for
a time slice. A decode step's torch ops (norms, RoPE, attention over one query row, the router,
sampling) are too small to gain from a second thread, yet on the built-in model torch opened 15
regions per token beside ggml's 31 (docs/KERNELS.md, "Thread discipline"). So steps of at most
``DECODE_TOKENS`` tokens run torch at one thread, and ggml's graphs keep every thread;
prefill's larger attention keeps torch's threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Steps of at most this many new tokens (all sequences together) run torch single-threaded:
# decode of up to 16 sequences; prompt chunks are larger (--step-tokens, 512 by default).
DECODE_TOKENS = 16


@contextmanager
def torch_threads_for_step(n_tokens: int) -> Iterator[None]:
    """Within: torch at one thread when the step carries at most ``DECODE_TOKENS`` tokens
    (0.2 us to switch and back), else unchanged."""
    threads = torch.get_num_threads()
    if n_tokens > DECODE_TOKENS or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
