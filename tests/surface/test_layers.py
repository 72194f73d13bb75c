"""The package's import graph: no circle, and no import from a lower layer to a higher one.

Every import counts, also those inside functions and under ``TYPE_CHECKING`` (a call back up is a
circle whatever the import's place). The layers, lowest first, are the ones CONTRIBUTING.md and
docs/architecture.md describe; a new top-level module gets a line in ``LAYERS``.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "gcore"

# lowest first; a module belongs to the first entry that is it or a package above it
LAYERS: list[tuple[str, ...]] = [
    ("gcore.errors", "gcore.types", "gcore.balance", "gcore.tasks", "gcore.liveness", "gcore.rendezvous",
     "gcore.registry", "gcore.report", "gcore.checkpoint", "gcore.model", "gcore.moe", "gcore.vision", "gcore.data",
     "gcore.assets", "gcore.threads", "gcore.environ", "gcore.loggers", "gcore.checkpointer", "gcore.run_lock",
     "gcore.user_code", "gcore.run_config", "gcore.run_dir", "gcore.tracing", "gcore.report_page"),
    ("gcore.engines",),
    ("gcore.rewards", "gcore.algorithms", "gcore.envs"),
    ("gcore.backends", "gcore.rollout", "gcore.evaluation"),
    ("gcore.placement",),
    ("gcore.inflight",),
    ("gcore.controller", "gcore.single_controller"),
    ("gcore.run_loop",),
    ("gcore.trainer", "gcore.testing", "gcore.simulator"),
    ("gcore.cli", "gcore.config_errors", "gcore.__main__", "gcore"),
]


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gcore":
                for alias in node.names:  # `from gcore.x import y` names module gcore.x.y when y is one
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in files else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "gcore")
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def layer(module: str) -> int:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes if p != "gcore"):
            return level
    if module == "gcore":
        return len(LAYERS) - 1
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/surface/test_layers.py")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
            for a, targets in sorted(graph.items()) for b in sorted(targets) if layer(b) > layer(a)]


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        for target in sorted(graph.get(node, ())):
            found = walk(target, path + [node])
            if found:
                return found
        done.add(node)
        return None

    for start in sorted(graph):
        circle = walk(start, [])
        if circle:
            return circle
    return None


def test_no_import_goes_up_a_layer():
    upward = upward_imports(import_graph())
    assert not upward, "\n".join(upward)


def test_no_import_circle():
    circle = find_circle(import_graph())
    assert circle is None, " -> ".join(circle)


def test_the_checks_catch_the_placement_controller_circle():
    """What placement looked like before its ``RolloutJob``: it called back into the controller."""
    graph = import_graph()
    graph["gcore.placement.base"] = graph["gcore.placement.base"] | {"gcore.controller"}
    assert find_circle(graph) is not None
    assert upward_imports(graph) == ["gcore.placement.base (layer 4) imports gcore.controller (layer 6)"]


def test_no_module_imports_the_lightning_package():
    """gcore uses Lightning Fabric as the ``lightning_fabric`` package: ``import lightning.fabric`` runs the
    ``lightning`` package's ``__init__``, which imports PyTorch Lightning and torchmetrics (with scipy and
    transformers' BERT) into every controller, engine worker and environment process, about 4 s of each start on a
    2-core CPU. PyTorch Lightning's W&B and MLflow loggers are the one exception, imported as ``pytorch_lightning``
    when such a logger is chosen."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT.parent)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[0] == "lightning"]
    assert not offenders, "; ".join(offenders)
