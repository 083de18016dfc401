"""The package's import rules, read from the source (every import, lazy ones inside functions
and type-only ones included): each package imports only its own layer and the layers below;
the frontend files never import the core's; the router never imports the server; no two
modules import each other, directly or round a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedkv

ROOT = Path(pagedkv.__file__).parent
# Lowest first; a package may import its own layer and those below it.
LAYERS = [
    {"utils", "jsonl", "bench"},  # leaf libraries: they import no other pagedkv package
    {"config"},
    {"kv", "structured", "kernels", "spec"},
    {"events", "store"},
    {"sched"},
    {"model"},
    {"engine"},
    {"http"},  # the HTTP surface the server and the router share
    {"server", "router"},
    {"sim"},
    {"commands", "cli"},  # (cli loads each command by name, through importlib)
    {"demo", "testing"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
FRONTEND = {f"pagedkv.engine.{name}" for name in (
    "llm", "llm_engine", "async_engine", "input_processor", "output_processor", "detokenizer",
    "outputs", "commands", "request_stream")}
CORE_ONLY = ("pagedkv.model", "pagedkv.sched.scheduler", "pagedkv.kv.manager",
             "pagedkv.engine.core")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the pagedkv modules it imports (`from a import b`: a.b when b is a module)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = graph[name] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = {f"{node.module}.{alias.name}" for alias in node.names}
                targets.update((subs & modules.keys()) or {node.module})
        graph[name] = {t for t in targets if t.startswith("pagedkv.") and t != name}
    return graph


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def violations(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    found = set()
    for source, targets in graph.items():
        for target in targets:
            upward = LAYER[target.split(".")[1]] > LAYER[source.split(".")[1]]
            core = source in FRONTEND and any(target == m or target.startswith(f"{m}.")
                                              for m in CORE_ONLY)
            to_server = source.startswith("pagedkv.router") and target.startswith("pagedkv.server")
            if upward or core or to_server or reaches(graph, target, source):
                found.add((source, target))
    return found


def test_every_package_has_a_layer():
    packages = {name.split(".")[1] for name in import_graph() if name != "pagedkv"}
    assert packages <= LAYER.keys(), f"place these in LAYERS: {sorted(packages - LAYER.keys())}"


def test_imports_follow_the_layers_and_never_go_round_a_circle():
    found = violations(import_graph())
    assert not found, f"imports against the rules: {sorted(found)}"
