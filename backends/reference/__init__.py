"""The reference backend: eager PyTorch, explicit masks, per-request contiguous KV. The oracle."""
