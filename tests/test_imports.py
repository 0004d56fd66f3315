"""The package's shape: no import cycle (top-level, ``TYPE_CHECKING`` and function-level
imports all count) and no module over :data:`MAX_LINES` lines; read from the source with
``ast``, nothing imported."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvevict

PACKAGE = Path(kvevict.__file__).parent
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of the package an import statement in ``module`` names: for ``from P import
    x``, ``P.x`` when that is a module, else ``P``; a name outside any module maps to its
    nearest enclosing module (``kvevict.cache.EvictionCache`` → ``kvevict.cache``)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".")
            if MODULES[module].name != "__init__.py":
                package = package[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports anywhere in its source (``ast.walk`` reaches
    imports inside ``if TYPE_CHECKING:`` blocks and functions alike)."""
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        nodes = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
        graph[module] = {name for node in nodes for name in imported(module, node)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "kvevict.cache" in graph["kvevict"]  # top level
    assert "kvevict.views" in graph["kvevict.policies.base"]  # inside `if TYPE_CHECKING:`
    assert "kvevict.demo" in graph["kvevict.commands.demo"]  # inside the handler
    assert "kvevict.bench.longbench" in graph["kvevict.bench.tasks"]  # `from kvevict.bench import longbench`


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle() -> None:
    assert find_cycle(import_graph()) is None


def test_no_module_is_over_the_size_limit() -> None:
    sizes = {str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines()) for path in MODULES.values()}
    oversized = {path: lines for path, lines in sizes.items() if lines > MAX_LINES}
    assert not oversized


LEAN_SCRIPT = """
import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import kvevict

config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
model = AutoModelForCausalLM.from_config(config).eval()
cache = kvevict.EvictionCache(model, "snapkv", budget=40)
with torch.no_grad():
    model(input_ids=torch.arange(80).remainder(96)[None], past_key_values=cache)
    model(input_ids=torch.tensor([[5]]), past_key_values=cache)
assert cache.layer_lengths() == [41, 41], cache.layer_lengths()

from kvevict.commands.common import EXTRAS  # last: it must not be what imports them

print(" ".join(sorted(name for name in EXTRAS["bench"] if name in sys.modules)))
"""


def test_the_library_imports_no_benchmark_stack() -> None:
    """``import kvevict`` and a cache at work on a model load nothing of ``kvevict[bench]``
    (a fresh interpreter: this one has the test suite's imports)."""
    result = subprocess.run([sys.executable, "-c", LEAN_SCRIPT], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == []
