"""CUDA drivers and kernels (numba-cuda; imported only when CUDA is used)."""
