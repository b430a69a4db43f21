"""draftline core: specs, registries, the state machine, sampling, models and methods.

Importing this package never imports Triton and never initialises CUDA.
"""
