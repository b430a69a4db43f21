"""The CUDA backend: persistent buffers, CUDA graphs and Triton kernels beside their callers.

Imported only when a spec asks for it: importing ``draftline.core`` never imports this package.
"""
