"""Routing traces: the format, importers, statistics, the cache simulator and hot-set profiles."""
