"""The package's layers are its folders: an import never points up (cli -> eval -> reading -> engine -> methods,
models -> kv -> io), the root holds three modules, and no unit grows past a screen or two."""

from __future__ import annotations

import ast
from pathlib import Path

import kvcli

ROOT = Path(kvcli.__file__).parent
#: Layer of each folder (and of the three modules) at the package root; a module may import only its own layer
#: or lower ones. The root's ``__init__`` is the public API, so it sits at the top with the CLI.
LAYERS = {
    "errors": 0, "io": 0,
    "kv": 1,
    "methods": 2, "models": 2,
    "engine": 3,
    "reading": 4,
    "eval": 5,
    "cli": 6, "integrations": 6, "__main__": 6, "__init__": 6,
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


def module_name(path: Path) -> str:
    parts = ("kvcli", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every kvcli module and the kvcli modules it imports anywhere: at the top, under ``TYPE_CHECKING``
    or inside a function (a lazy import still ties the two modules together)."""
    modules = {module_name(path): path for path in ROOT.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{name} uses a relative import; kvcli spells imports out")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvcli":
                for alias in node.names:  # `from kvcli.eval.bench import grid` imports the module kvcli.eval.bench.grid
                    sub = f"{node.module}.{alias.name}"
                    targets.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names if alias.name.split(".")[0] == "kvcli")
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_kvcli_modules():
    """Not even through a lazy or TYPE_CHECKING import: two modules that need each other are one concern
    split badly (issue #27: kvcli.eval.bench.grid and kvcli.eval.bench.results imported each other)."""
    graph = import_graph()
    assert "kvcli.eval.bench.results" in graph and "kvcli.engine.engine" in graph
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_documented_scripts_import_names_that_exist():
    """docs/results/*.py are the commands behind docs/results.md: a module split must not leave them importing
    a name from where it used to live (each would fail only when someone re-runs a measurement)."""
    import importlib

    scripts = sorted((Path(__file__).parent.parent / "docs" / "results").glob("*.py"))  # the checkout's
    assert scripts
    missing = []
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcli"):
                module = importlib.import_module(node.module)
                missing += [f"{script.name}: {node.module}.{alias.name}" for alias in node.names
                            if not hasattr(module, alias.name)]
    assert not missing, missing


def test_the_package_root_holds_only_the_front_door_and_its_folders():
    """A newcomer opening kvcli/ sees the layers as folders: at the root only the public API (``__init__``),
    ``python -m kvcli`` (``__main__``) and the errors every layer raises."""
    modules = sorted(path.name for path in ROOT.glob("*.py"))
    assert modules == ["__init__.py", "__main__.py", "errors.py"]
    folders = sorted(path.name for path in ROOT.iterdir() if (path / "__init__.py").is_file())
    assert set(folders) == set(LAYERS) - {"errors", "__init__", "__main__"}


#: The longest a function (def to its last line, docstring included) and a class may be.
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 150


def test_no_function_over_80_lines_and_no_class_over_150():
    """A unit that outgrows a screen or two mixes concerns (issue #52): split it by concern, not by count."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            limit = (MAX_CLASS_LINES if isinstance(node, ast.ClassDef)
                     else MAX_FUNCTION_LINES if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None)
            if limit and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
