"""CPU drivers and kernels (Numba ``njit``, parallel over work items)."""
