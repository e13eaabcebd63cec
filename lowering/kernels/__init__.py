"""Triton kernels for the sparse_fx ops (CUDA path; tested on CPU under TRITON_INTERPRET=1)."""
