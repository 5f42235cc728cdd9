"""The package's shape stays what docs/source-tree.md draws: every folder imports only
the folders below it, no module imports itself back through others (no circle), and no
module grows past 500 lines.

The import graph is read from the source (``ast``: every ``import`` statement,
function-level ones included), not from a running interpreter, so a lazy import that
runs back up is caught as surely as a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "boost_titan"

# Bottom to top: a folder may import its own modules and those of the layers below it.
# Folders on one line are independent of each other.
LAYERS = (
    ("config",),
    ("models", "observability"),
    ("tp_plans", "optim"),
    ("parallel",),
    ("checkpoint",),
    ("data",),
    ("train",),
    ("perf",),
    ("cli",),
)
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join(up) + (f".{base}" if base else "")
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in mods:  # `import boost_titan.x.y.attr` -> the module
                t = t.rpartition(".")[0]
            if t.startswith("boost_titan") and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _layer_of() -> dict[str, int]:
    return {folder: i for i, line in enumerate(LAYERS) for folder in line}


def test_every_top_level_entry_has_a_layer():
    layer = _layer_of()
    entries = {
        p.stem if p.suffix == ".py" else p.name
        for p in PACKAGE.iterdir()
        if p.name not in ("__init__.py", "__pycache__", "py.typed")
    }
    assert entries == set(layer), (
        f"top-level entries {sorted(entries - set(layer))} have no layer in LAYERS; "
        f"layers {sorted(set(layer) - entries)} name nothing"
    )
    assert len(entries) + 1 <= 12  # + py.typed: at most a dozen entries besides __init__.py


def test_no_import_runs_up_a_layer():
    layer = _layer_of()
    upward = []
    for mod, deps in sorted(_graph().items()):
        src = _folder(mod)
        for dep in sorted(deps):
            dst = _folder(dep)
            if src is None or dst is None or src == dst:
                continue
            if layer[dst] >= layer[src]:
                upward.append(f"{mod} -> {dep} ({src} is not above {dst})")
    assert not upward, "imports that run up or sideways:\n" + "\n".join(upward)


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    circles = []

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                circles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_module_over_500_lines():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_every_folder_says_its_job():
    silent = [
        str(init.relative_to(PACKAGE.parent))
        for init in PACKAGE.rglob("__init__.py")
        if not (ast.get_docstring(ast.parse(init.read_text())) or "").strip()
    ]
    assert not silent, f"packages whose __init__.py has no docstring: {silent}"
