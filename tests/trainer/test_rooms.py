"""The trainer's rooms import one way (docs/trainer.md, "Where things are"): the run (`train/`) uses the models and
the parallel modes, the models use only `parallel/tensors.py`, the parallel modes use neither; and no module of
the paratrain package imports itself back through others. Read from the source, as text: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trainer" / "paratrain"
TRAIN = "paratrain.train"
MODELS_MAY_USE = {f"{TRAIN}.parallel.tensors"}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: modules of the package it imports}, function-level imports included. `from pkg import name`
    counts as importing `pkg.name` where that is a module of the package, else `pkg`."""
    files = {_module(path, root): path for path in root.rglob("*.py")}
    graph = {}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                elif (node.module or "").startswith("paratrain"):
                    base = node.module
                else:
                    continue
                deps |= {f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
        graph[module] = deps - {module}
    return graph


def _module(path: Path, root: Path) -> str:
    parts = (root.name, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str | None:
    """'parallel', 'models' or 'run' for a module of paratrain.train; None outside it."""
    if not module.startswith(TRAIN + "."):
        return None
    inner = module.removeprefix(TRAIN + ".").split(".")[0]
    return inner if inner in ("parallel", "models") else "run"


def room_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for module, deps in graph.items():
        for dep in deps:
            if room(module) == "parallel" and room(dep) in ("models", "run"):
                out.append(f"{module} -> {dep}: the parallel modes use no model and no part of the run")
            if room(module) == "models" and (room(dep) == "run" or room(dep) == "parallel" and dep not in
                                             MODELS_MAY_USE):
                out.append(f"{module} -> {dep}: the models use only {sorted(MODELS_MAY_USE)}")
    return sorted(out)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each module that lies on one (depth-first, from each module in turn)."""
    found, on_cycle = [], set()
    for start in sorted(graph):
        if start in on_cycle:
            continue
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in sorted(graph.get(node, ())):
                if dep == start:
                    found.append(path + [start])
                    on_cycle.update(path)
                    stack = []
                    break
                if dep not in seen:
                    seen.add(dep)
                    stack.append((dep, path + [dep]))
    return found


def test_the_trainer_rooms_import_one_way():
    assert room_violations(import_graph()) == []


def test_the_package_has_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_checks_see_a_back_import_and_a_circle():
    """Both checks fail where they should: a parallel mode importing a model, and a loop of two modules."""
    graph = import_graph()
    graph[f"{TRAIN}.parallel.dims"] = graph[f"{TRAIN}.parallel.dims"] | {f"{TRAIN}.models.registry"}
    graph[f"{TRAIN}.models.registry"] = graph[f"{TRAIN}.models.registry"] | {f"{TRAIN}.parallel.dims"}
    assert any("parallel.dims -> paratrain.train.models.registry" in v for v in room_violations(graph))
    assert [f"{TRAIN}.models.registry", f"{TRAIN}.parallel.dims", f"{TRAIN}.models.registry"] in cycles(graph)
    assert {f"{TRAIN}.deepspeed_engine", f"{TRAIN}.parallel.parallelize"} <= import_graph()[f"{TRAIN}.build"]
