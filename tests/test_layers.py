"""The import graph points one way: a module imports its own layer and the ones below, never a
higher one, and no modules import each other in a cycle. Imports inside functions count too.
The table is docs/ARCHITECTURE.md's."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "moeswap"

# bottom up; a name is a top-level module or subpackage of moeswap
LAYERS = [
    ("errors", "formats", "quant", "memory", "sampling", "chat_template", "context_window",
     "special_text", "template_library"),
    ("tokenizer", "models"),
    ("routing",),
    ("experts",),
    ("generate", "runtime", "trace_capture", "gguf_tools"),
    ("planner",),
    ("chat", "server", "bench"),
    ("cli", "__init__", "__main__"),
]
LAYER_OF = {name: level for level, names in enumerate(LAYERS, start=1) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF[parts[1] if len(parts) > 1 else "__init__"]


def imported(module: str) -> set[str]:
    """moeswap modules ``module`` imports anywhere in its body. ``from a import b`` imports the
    module a.b when there is one, else a."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package up level - 1 parents
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES and name != module}


GRAPH = {module: imported(module) for module in MODULES}


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if m.split(".")[1:2] and m.split(".")[1] not in LAYER_OF)
    assert unplaced == []


def test_no_module_imports_a_higher_layer():
    upward = sorted(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
                    for m, targets in GRAPH.items() for t in targets if layer(t) > layer(m))
    assert upward == []


def test_no_import_cycle():
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert cycles == []


def test_no_module_over_500_lines():
    long = sorted(f"{m}: {n}" for m, p in MODULES.items()
                  if (n := len(p.read_text().splitlines())) > 500)
    assert long == []
