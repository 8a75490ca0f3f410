"""Kept only for ``cli/run_commands.save_trace``, which still imports ``model_name`` from here.

Trace capture (running a model to record its routing) moved to ``moeswap.trace_capture``
(layer 5, beside runtime and generate); ``model_name`` now lives in ``moeswap.routing.traces``.
Delete this module once run_commands imports ``model_name`` from there.
"""

from moeswap.routing.traces import model_name

__all__ = ["model_name"]
