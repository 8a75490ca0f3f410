"""Expert residency: which routed experts stay in fast memory."""
