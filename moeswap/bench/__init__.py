"""``moeswap bench``: scenarios run side by side by moeswap and llama.cpp, each run in its own
worker process (moeswap.bench.worker), reported as JSON, markdown and plots (docs/BENCHMARKS.md).
"""
