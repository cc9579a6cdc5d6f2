"""The package's layers, read from its own source: imports flow one way only.

tools -> public face -> operations -> kernels -> core.  No operation imports another
operation, kernels never import operations, the core imports nothing above it, and the
CPU and CUDA kernels share only what lives in ``kernels.shared``.  Every import counts,
including those inside functions (the lazy ones).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "numattn"

#: Public operation modules: each checks its arguments and dispatches to kernels.
OPERATIONS = {"numattn.flash", "numattn.decode", "numattn.cross", "numattn.merge",
              "numattn.kv_cache"}
#: Public modules that only re-export the data model or compute the reference.
FACADES = {"numattn.masks", "numattn.reference"}


def layer(module):
    """The layer a module of the package belongs to."""
    if module in ("numattn", "numattn.__main__", "numattn.dask"):
        return "face"
    if module in OPERATIONS:
        return "operation"
    if module in FACADES:
        return "facade"
    for prefix in ("numattn.tools", "numattn.integrations", "numattn.kernels.shared",
                   "numattn.kernels.cpu", "numattn.kernels.cuda", "numattn.kernels",
                   "numattn.core"):
        if module == prefix or module.startswith(prefix + "."):
            return prefix.removeprefix("numattn.")
    raise AssertionError(f"{module} belongs to no layer: add it to test_layers.py")


#: What each layer may import from the package (besides itself).
ALLOWED = {
    "core": {"core"},
    "kernels": {"core", "kernels.shared", "kernels.cpu", "kernels.cuda"},
    "kernels.shared": {"core", "kernels.shared"},
    "kernels.cpu": {"core", "kernels.shared", "kernels.cpu"},
    "kernels.cuda": {"core", "kernels.shared", "kernels.cuda"},
    "operation": {"core", "kernels", "kernels.shared", "kernels.cpu", "kernels.cuda"},
    "facade": {"core"},
    "face": {"core", "operation", "facade", "tools"},
    "tools": {"core", "kernels", "kernels.shared", "kernels.cpu", "kernels.cuda", "operation",
              "facade", "face", "tools"},
    # bridges to other libraries sit on top, beside the tools, and use the public face
    "integrations": {"face", "facade", "integrations"},
}


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


def imports_of(module, path):
    """The package modules that ``module`` imports, with the line of each import."""
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "numattn":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "numattn":
                continue
            # ``from . import flash`` imports the module numattn.flash
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() or (
                        PACKAGE.parent / candidate.replace(".", "/")).is_dir():
                    yield candidate, node.lineno
                else:
                    yield target, node.lineno


def test_every_module_has_a_layer():
    for module, _ in modules():
        layer(module)


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda x: str(x))
def test_imports_flow_one_way(module, path):
    own = layer(module)
    for target, line in imports_of(module, path):
        if target == "numattn":
            assert own in ("tools", "face", "integrations"), (
                f"{module}:{line} imports the package's face")
            continue
        other = layer(target)
        if other == own and own == "operation":
            assert target == module, f"{module}:{line}: an operation imports {target}"
            continue
        if other == own:
            continue
        assert other in ALLOWED[own], (
            f"{module}:{line} ({own}) imports {target} ({other}); {own} may import only "
            f"{sorted(ALLOWED[own])}")


def test_import_rules_catch_a_violation(tmp_path):
    """The walker sees lazy relative imports (a kernel importing an operation)."""
    source = tmp_path / "split_k.py"
    source.write_text("def f():\n    from ...decode import decode_attention\n")
    found = list(imports_of("numattn.kernels.cpu.split_k", source))
    assert found == [("numattn.decode", 2)]
    assert layer("numattn.decode") not in ALLOWED["kernels.cpu"]
