"""Command-line tools: ``check``, ``bench`` and ``demo`` (``python -m numattn``)."""
