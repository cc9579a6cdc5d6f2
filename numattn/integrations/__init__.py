"""Bridges from other libraries to numattn's operations.

Nothing here is imported by ``import numattn``: each bridge imports its library, so it is
imported by name where it is wanted (``import numattn.integrations.transformers``).
"""
