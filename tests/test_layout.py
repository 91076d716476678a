"""The package's floor plan: stages in data-flow order, and no import runs back up them.

Read from the source (every import, module-level, inside functions and under TYPE_CHECKING), so a
back edge fails here the day it is written, whatever the runtime import order.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "unstable_dask"
# Floors, lowest first: a module may import its own floor and the ones below, never one above.
FLOORS = [
    ("ground", ["unstable_dask.errors", "unstable_dask.config", "unstable_dask.skill", "unstable_dask"]),
    ("lake", ["unstable_dask.lake"]),
    ("inference", ["unstable_dask.inference"]),
    ("cluster", ["unstable_dask.cluster"]),
    ("play", ["unstable_dask.play"]),
    ("learn", ["unstable_dask.learn"]),
    ("rate", ["unstable_dask.rate"]),
    ("report", ["unstable_dask.report"]),
    ("top", ["unstable_dask.jobfile", "unstable_dask.jobkeys", "unstable_dask.loop", "unstable_dask.cli",
             "unstable_dask.run"]),
]


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def floor(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(FLOORS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is on no floor of tests/test_layout.py"
    return best


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("unstable_dask")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("unstable_dask"):
            out.add(node.module)
            # `from unstable_dask.lake import catalog` imports the submodule unstable_dask.lake.catalog
            out |= {f"{node.module}.{a.name}" for a in node.names
                    if (PKG.parent / node.module.replace(".", "/") / f"{a.name}.py").is_file()}
    return out


def test_every_module_is_on_a_floor_and_no_import_runs_back_up():
    back = []
    for path in sorted(PKG.rglob("*.py")):
        me = module_name(path)
        for other in imports(path):
            if floor(other) > floor(me):
                back.append(f"{me} ({FLOORS[floor(me)][0]}) imports {other} ({FLOORS[floor(other)][0]})")
    assert not back, "imports that run back up the stages:\n" + "\n".join(back)


def dependencies(path: Path) -> set[str]:
    """The modules `path` needs, imports under TYPE_CHECKING and inside functions included;
    `from pkg import submodule` needs the submodule, not what pkg's __init__ defines."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("unstable_dask")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("unstable_dask"):
            subs = {f"{node.module}.{a.name}" for a in node.names
                    if (PKG.parent / node.module.replace(".", "/") / f"{a.name}.py").is_file()}
            out |= subs | ({node.module} if len(subs) < len(node.names) else set())
    return out


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` (module -> modules it needs), or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return []


def test_no_import_circle_types_included():
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {m: {d for d in dependencies(p) if d in modules and d != m} for m, p in modules.items()}
    assert import_cycle(graph) == []
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail


def test_the_checker_sees_a_back_edge(tmp_path):
    """The test above can fail: a lake module importing the learner is caught."""
    bad = PKG / "lake" / "catalog.py"
    assert floor(module_name(bad)) < floor("unstable_dask.learn.learner")
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from unstable_dask.learn.learner import plan\n")
    assert "unstable_dask.learn.learner" in imports(src)


def test_importing_the_package_and_loading_a_job_import_neither_torch_nor_a_stage():
    code = ("import sys\nimport unstable_dask\n"
            "assert not [m for m in sys.modules if m.startswith('unstable_dask.')], sorted(sys.modules)\n"
            "from unstable_dask.jobfile import load_job\nload_job(None)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "assert 'unstable_dask.rate.ratings' not in sys.modules and 'unstable_dask.play.round' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
