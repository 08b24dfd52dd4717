"""The package's layers: an import never points up (CLI -> workflows -> inputs -> core -> shared)."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcli

ROOT = Path(kvcli.__file__).parent
#: Layer of each top-level module or package of kvcli; a module may import only its own layer or lower ones.
LAYERS = {
    "cli": 4, "__main__": 4, "lm_eval": 4,
    "perplexity": 3, "kl": 3, "generate": 3, "needle": 3, "bench": 3, "analysis": 3, "adapt": 3, "corpus": 3,
    "checkpoint": 3, "needle_plot": 3,
    "models": 2, "text": 2, "presets": 2,
    "engine": 1, "methods": 1, "pod": 1, "cache": 1, "attention": 1, "architecture": 1,
    "report": 0, "plots": 0, "errors": 0, "outputs": 0, "statefile": 0, "distributed": 0, "__init__": 0,
    "modelcache": 0, "lazy": 0,
}


def imported_kvcli_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcli."):
            names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names.update(alias.name.split(".")[1] for alias in node.names if alias.name.startswith("kvcli."))
    return names


def test_every_module_has_a_layer_and_no_import_points_up():
    for path in ROOT.rglob("*.py"):
        top = path.relative_to(ROOT).parts[0].removesuffix(".py")
        assert top in LAYERS, f"{top} has no layer in this test and in docs/engine.md"
        for name in imported_kvcli_modules(path):
            assert LAYERS[name] <= LAYERS[top], f"{path.relative_to(ROOT)} imports kvcli.{name}, a higher layer"
