"""The package installs under one namespace, the CLI is on PATH, and the tree reads
as its docs say: no import cycle, the engine apart from the server, short functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def test_namespaced_imports():
    subprocess.run(
        [sys.executable, "-c", "import mlx_nursery.actors, mlx_nursery.server"], check=True
    )


def test_console_script_is_installed():
    exe = Path(sys.executable).parent / "mlx-nursery"
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    assert "serve" in out.stdout


# -- what a reader of the tree relies on ------------------------------------------

PACKAGES = {"actors": "mlx_nursery.actors", "server": "mlx_nursery.server"}
ROOT = Path(__file__).resolve().parent.parent
# The actor modules (docs/engine.md): the GPU-thread state in actors/step/ is
# handed to them and imports none of them.
ACTORS = ("engine", "admission", "prefill", "decode", "serial", "emitter", "prompt_cache",
          "stats", "gpu", "watchdog")  # fmt: skip
# A function's code lines (no docstring, comments or blank lines) beyond this are
# split: a reader should see a function whole.
LONGEST_FUNCTION = 60


def _modules() -> dict[str, Path]:
    out = {}
    for folder, name in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            out[".".join([name, *(p for p in parts if p != "__init__")])] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports, anywhere in it (type-only and
    function-local imports count: a cycle through them is still a cycle)."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                target = ".".join(base[: len(base) - node.level + 1] + ([target] if target else []))
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.add(full if full in modules else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def test_the_package_has_no_import_cycle():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = [*trail[trail.index(name) :], name]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for dep in sorted(graph[name]):
            visit(dep, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    engine = [n for n, deps in graph.items() if n.startswith(PACKAGES["actors"])
              and any(d.startswith(PACKAGES["server"]) for d in deps)]  # fmt: skip
    assert not engine, f"the engine imports the server: {engine}"
    actors = {f"{PACKAGES['actors']}.{name}" for name in ACTORS}
    step = {n: deps & actors for n, deps in graph.items() if ".actors.step" in n}
    assert not any(step.values()), f"the GPU-thread state imports an actor: {step}"
    # The kernels are a room below both: they import no actor and no step state.
    below = {n: {d for d in deps if d in actors or ".actors.step" in d}
             for n, deps in graph.items() if ".actors.kernels" in n}  # fmt: skip
    assert not any(below.values()), f"a kernel imports an actor or the step: {below}"
    # Speculation serves the batch from above: the step state never imports it.
    up = {n: {d for d in deps if ".actors.speculation" in d}
          for n, deps in graph.items() if ".actors.step" in n}  # fmt: skip
    assert not any(up.values()), f"the step state imports speculation: {up}"
    # The actors are peers: they meet through actors/messages.py (and rows, stats
    # and the GPU actor, which serve them all); only the engine wires them.
    peers = actors - {f"{PACKAGES['actors']}.{name}" for name in ("engine", "stats", "gpu")}
    reach = {n: graph[n] & peers for n in peers}
    assert not any(reach.values()), f"an actor imports another: {reach}"


def _code_lines(node: ast.AST, lines: list[str]) -> int:
    body = node.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body:
        return 0
    text = lines[body[0].lineno - 1 : node.end_lineno]
    return sum(1 for line in text if line.strip() and not line.strip().startswith("#"))


def test_no_function_is_longer_than_a_reader_can_hold():
    long = []
    for name, path in _modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = _code_lines(node, lines)
                if n > LONGEST_FUNCTION:
                    long.append(f"{name}.{node.name}: {n} lines")
    assert not long, long
