"""Backends that execute the state machine: `reference` (eager PyTorch) and `cuda`."""
