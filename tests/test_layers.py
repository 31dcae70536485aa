"""The import order of DESIGN.md section 2, enforced: dependencies point downward only.

Reads every module under vllm/ with `ast` (nothing is imported) and collects
its imports of vllm modules: module level, inside functions, and under
`if TYPE_CHECKING:` (a type-only import still couples two layers and, both
ways round, is a cycle). Then:

- every module belongs to exactly one layer of `LAYERS`;
- a module imports only from its own layer or a layer below;
- the modules form no import cycle (between modules, any layer);
- vllm/v1/core imports no torch, not even through what it imports (runtime
  imports only: a TYPE_CHECKING import of a torch type costs nothing).

A failure names the file, the line and both layers, so the fix is clear:
move the class down (or the import up), or pass the value in from above.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm"

# Top to bottom. A module may import its own layer and any layer *below* it.
# Prefixes match a module and its submodules ("vllm.v1.core" matches
# "vllm.v1.core.sched.scheduler"); the longest matching prefix wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("package", ("vllm",)),  # vllm/__init__.py: lazy public names, nothing imports it
    ("entrypoints", ("vllm.entrypoints", "vllm.benchmarks")),
    ("engine", ("vllm.engine", "vllm.v1.engine", "vllm.v1.metrics", "vllm.v1.executor")),
    ("core/worker", (
        "vllm.v1.core", "vllm.v1.request", "vllm.v1.worker", "vllm.v1.spec_decode",
        "vllm.distributed.kv_transfer",
    )),
    ("config", ("vllm.config",)),  # resolved from the platform; read by engine and worker
    ("model_executor/attention", (
        "vllm.model_executor", "vllm.attention", "vllm.v1.attention", "vllm.v1.sample",
        "vllm.forward_context", "vllm.v1.kv_cache_interface",
    )),
    ("device_allocator/platforms", (
        "vllm.device_allocator", "vllm.platforms", "vllm.utils", "vllm.distributed",
    )),
    # Shared leaves: torch-free types and helpers every layer may use.
    ("foundation", (
        "vllm.logger", "vllm.version", "vllm.exceptions", "vllm.inputs", "vllm.outputs",
        "vllm.logprobs", "vllm.sampling_params", "vllm.transformers_utils", "vllm.v1.outputs",
        "vllm.v1",  # the bare namespace package vllm/v1/__init__.py
    )),
]


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # module name
    path: pathlib.Path  # relative to the tree's root
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, type_only: bool = False):
    """(node, under TYPE_CHECKING) for every import node below `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, type_only
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _walk(ast.Module(body=[stmt], type_ignores=[]), type_only)
        else:
            yield from _walk(child, type_only)


def collect_imports(root: pathlib.Path, package: str = "vllm") -> tuple[set[str], list[Import]]:
    """Every module under root/package and every import of one of them (plus torch)."""
    files = sorted((root / package).rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    imports = []
    for path in files:
        importer = module_name(path, root)
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node, type_only in _walk(tree):
            for target in _targets(node, importer, is_package, modules, package):
                rel = path.relative_to(root)
                imports.append(Import(importer, target, rel, node.lineno, type_only))
    return modules, imports


def _targets(node, importer: str, is_package: bool, modules: set[str], package: str) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: resolve against the importer's package
            anchor = importer.split(".")
            anchor = anchor if is_package else anchor[:-1]
            anchor = anchor[: len(anchor) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        # `from pkg import sub` imports the submodule pkg.sub when there is one.
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        if name == "torch" or name.startswith("torch."):
            out.append("torch")
        elif name == package or name.startswith(package + "."):
            while name not in modules and "." in name:  # `import vllm.a.b.func`-like
                name = name.rsplit(".", 1)[0]
            out.append(name)
    return out


def layer_of(module: str) -> int | None:
    best, best_len = None, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or module.startswith(prefix + ".")
            if prefix == "vllm":
                matches = module == "vllm"  # the package itself only
            if matches and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    return best


def upward_imports(imports: list[Import]) -> list[str]:
    """One message per import that points up the layer order."""
    problems = []
    for imp in imports:
        if imp.imported == "torch":
            continue
        low, high = layer_of(imp.importer), layer_of(imp.imported)
        if low is not None and high is not None and high < low:
            problems.append(
                f"{imp.path}:{imp.line}: {imp.importer} "
                f"({LAYERS[low][0]}) imports {imp.imported} ({LAYERS[high][0]}), a layer "
                f"above it{' (type-only)' if imp.type_only else ''}"
            )
    return problems


def find_cycles(imports: list[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.imported != "torch" and imp.imported != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.imported)
            graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def torch_reachable_from(imports: list[Import], roots: set[str]) -> dict[str, list[str]]:
    """Runtime import chains from `roots` that end in torch (shortest first)."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if not imp.type_only:
            graph.setdefault(imp.importer, set()).add(imp.imported)
    found = {}
    for root in sorted(roots):
        queue, seen = [[root]], {root}
        while queue:
            chain = queue.pop(0)
            if chain[-1] == "torch":
                found[root] = chain
                break
            for nxt in sorted(graph.get(chain[-1], ())):
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(chain + [nxt])
    return found


# ---------------------------------------------------------------- the checks

MODULES, IMPORTS = collect_imports(ROOT)


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, f"add these modules to a layer in tests/test_layers.py: {unplaced}"


def test_imports_point_downward():
    problems = upward_imports(IMPORTS)
    assert not problems, "upward imports (DESIGN.md section 2):\n" + "\n".join(problems)


def test_no_import_cycles():
    cycles = find_cycles(IMPORTS)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_core_is_torch_free():
    core = {m for m in MODULES if m.startswith("vllm.v1.core") or m == "vllm.v1.request"}
    chains = torch_reachable_from(IMPORTS, core)
    assert not chains, "v1/core reaches torch:\n" + "\n".join(
        " -> ".join(chain) for chain in chains.values()
    )


# ------------------------------------------------- the checker itself can fail


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> tuple[set[str], list[Import]]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return collect_imports(tmp_path)


def test_checker_reports_an_upward_import(tmp_path):
    _, imports = _tree(tmp_path, {
        "vllm/__init__.py": "",
        "vllm/v1/__init__.py": "",
        "vllm/v1/engine/__init__.py": "",
        "vllm/v1/engine/core.py": "class EngineCore: ...\n",
        "vllm/v1/core/__init__.py": "",
        "vllm/v1/core/block_pool.py": "from vllm.v1.engine.core import EngineCore\n",
    })
    (problem,) = upward_imports(imports)
    assert "vllm.v1.core.block_pool (core/worker) imports vllm.v1.engine.core (engine)" in problem


def test_checker_reports_type_only_cycles_and_torch_reached_indirectly(tmp_path):
    _, imports = _tree(tmp_path, {
        "vllm/__init__.py": "",
        "vllm/a.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vllm.b import B\n"
        ),
        "vllm/b.py": "def f():\n    from vllm import a\n",
        "vllm/c.py": "import vllm.d\n",
        "vllm/d.py": "import torch.nn\n",
    })
    assert find_cycles(imports) == [["vllm.a", "vllm.b"]]
    assert torch_reachable_from(imports, {"vllm.c"}) == {"vllm.c": ["vllm.c", "vllm.d", "torch"]}
    assert torch_reachable_from(imports, {"vllm.a"}) == {}  # type-only imports cost nothing
