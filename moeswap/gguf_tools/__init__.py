"""GGUF tools: inspect, doctor, fix (and convert)."""
