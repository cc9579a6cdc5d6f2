"""Attention kernels: ``shared`` bodies compiled for both targets, ``cpu`` and ``cuda``
drivers and kernels."""
