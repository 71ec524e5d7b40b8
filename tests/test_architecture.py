"""The architecture as a test: subpackages import only the layers below them, no module imports itself through a
cycle, and library code names no folder outside the repository."""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "deberta_jax"
# What each subpackage may import (the layers: storage -> data, kernels -> model -> train -> study, export -> aot).
ALLOWED = {
    "storage": {"storage"},
    "data": {"storage", "data"},
    "kernels": {"kernels"},
    "model": {"storage", "kernels", "model"},
    "train": {"storage", "data", "kernels", "model", "train"},
    "study": {"storage", "data", "kernels", "model", "train", "study"},
    "export": {"storage", "data", "kernels", "model", "train", "export"},
    "aot": {"storage", "data", "kernels", "model", "train", "study", "aot"},
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """The deberta_jax modules `path` imports anywhere (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deberta_jax"):
            for alias in node.names:  # `from deberta_jax.data import packing` imports the module packing
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if (ROOT / candidate.replace(".", "/")).with_suffix(".py").exists()
                          else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("deberta_jax")}
    return found


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.count(".") >= 2))
def test_module_imports_only_lower_layers(module):
    layer = module.split(".")[1]
    used = {target.split(".")[1] for target in MODULES[module] if target.count(".") >= 1}
    assert used <= ALLOWED[layer], f"{module} ({layer}) imports from {sorted(used - ALLOWED[layer])}"


def test_import_graph_has_no_cycle():
    graph = {module: {t for t in targets if t in MODULES and t != module} for module, targets in MODULES.items()}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_every_module_is_in_a_layer():
    loose = [m for m in MODULES if m.count(".") == 1 and not (PACKAGE / m.split(".")[1]).is_dir()]
    assert not loose, f"modules outside the subpackages: {loose}"


def test_library_and_configs_name_no_folder_outside_the_repository():
    offenders = [str(p.relative_to(ROOT)) for folder in ("deberta_jax", "configs")
                 for p in (ROOT / folder).rglob("*.py") if "../" in p.read_text()]
    assert not offenders, f"these files name paths outside the repository: {offenders}"
