"""The house stays layered: each module imports only from its own layer or the ones below, and no
modules import each other in a circle. Read from the source (every import statement, function-level
ones included), so a new upward import fails here, not in review.

    cache_manager < config, logs < model < engine < metrics < chat < engine client < server | Python API
    < entry points

The gRPC server and the Python API are two ways in over one engine: neither imports the other (what
both need lives below them). Both reach the engine through the engine client (service.engine_client:
the `EngineClient` protocol, its in-process and engine-process implementations, and the engine
process itself). Below the entry points, a layer's packages do not import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Most specific prefix wins. Entry points of processes (the CLI, a tensor-parallel rank's main, the
# engine process's main) sit at the top whatever package holds them.
LAYERS = {
    "cache_manager": 0,
    "service.config": 1,
    "service.proto": 1,
    "service.telemetry.log": 1,
    "service.telemetry.gc_pauses": 1,
    "service.telemetry.startup": 1,
    "service.model_dirs": 1,
    "service.model": 2,
    "service.engine": 3,
    "service.telemetry": 4,
    "service.chat": 5,
    "service.engine_client": 6,
    "service.server": 7,
    "service.llm": 7,
    "service.llm_config": 7,
    "service.outputs": 7,
    "service": 8,
    "service.engine.rank_main": 8,
}
TOP = 8
NAMES = {0: "cache_manager", 1: "config and logs", 2: "model", 3: "engine", 4: "metrics", 5: "chat",
         6: "engine client", 7: "server | Python API", 8: "entry points"}


# Packages of one layer that are one part (may import each other).
PARTS = {"service.llm_config": "service.llm", "service.outputs": "service.llm"}


def part(module: str) -> str:
    """The part of its layer a module belongs to: the prefix that decides its layer, at most two deep."""
    parts = module.split(".")
    prefix = next(".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in LAYERS)
    return PARTS.get(prefix, ".".join(prefix.split(".")[:2]))


def layer(module: str) -> int | None:
    """None: not ours (a library)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


def modules() -> dict[str, Path]:
    found = {}
    for top in ("service", "cache_manager"):
        for path in (ROOT / top).rglob("*.py"):
            if "proto" in path.relative_to(ROOT).parts[:2]:
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports(path: Path, module: str, known: set[str], module_level: bool = False) -> set[str]:
    """The modules `module` imports: `from package import module` names the module, not the package
    (whose __init__ Python runs first, a mechanism, not a dependency of this module's code).
    module_level: only those at module level (type-checking imports included: a circle of types is a
    circle of design), not those inside functions."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree)
    if module_level:
        nodes = [n for top in tree.body for n in ([top] + (top.body if isinstance(top, ast.If) else []))]
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                package = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    ours = modules()
    for module, path in sorted(ours.items()):
        mine = layer(module)
        for target in sorted(imports(path, module, set(ours))):
            theirs = layer(target)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} ({NAMES[mine]}) imports {target} ({NAMES[theirs]})")
            elif theirs == mine < TOP and part(target) != part(module):
                upward.append(f"{module} imports {target}, a sibling in its layer ({NAMES[mine]})")
    assert not upward, "\n".join(upward)


def test_no_import_circles() -> None:
    ours = modules()
    graph = {m: {t for t in imports(p, m, set(ours), module_level=True) if t in ours and t != m} for m, p in ours.items()}
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                circles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "\n".join(circles)


def test_the_rules_see_an_upward_import(tmp_path: Path) -> None:
    """The reader itself: a model module importing the engine is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from service.engine.request import Constraint\n")
    assert "service.engine.request" in imports(bad, "service.model.bad", set(modules()))
    assert layer("service.engine.request") > layer("service.model.bad")
