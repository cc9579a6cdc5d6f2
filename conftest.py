"""Collection of the package's doctests: the transformers bridge imports torch and
transformers, so its module is left out where they are not installed."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
    collect_ignore.append("numattn/integrations/transformers.py")
