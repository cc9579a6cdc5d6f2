"""Sphinx configuration for numattn (built by ``tox -e docs`` with warnings as errors)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import numattn

project = "numattn"
author = "numattn developers"
copyright = "2026, numattn developers"
release = numattn.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "numpydoc",
]
autosummary_generate = False
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks = {"PR01", "PR02", "RT01"}
autodoc_default_options = {"members": False}
intersphinx_mapping = {}
templates_path = []
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_theme_options = {
    "description": "Production attention kernels for NumPy",
    "fixed_sidebar": True,
}
