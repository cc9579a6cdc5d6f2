"""Plain-Python bodies compiled for the CPU (Numba) and CUDA (numba-cuda) alike."""
