"""The layers of docs/design.md ("The layers"), enforced: dependencies point downward only.

Reads every module under vllm/ with `ast` (nothing is imported) and collects
its imports of vllm modules (and of torch): module level, inside functions,
and under `if TYPE_CHECKING:`. A type-only import counts like any other: it
still couples two layers and, both ways round, is a cycle. Then:

- every module belongs to exactly one layer of `LAYERS` (longest prefix wins),
  and every prefix there names a module that exists;
- a module imports only from its own layer or a layer below (`upward_imports`);
- `NEVER_PAIRS`, the couplings that broke the design before, are refused
  whatever the layers say (`never_pair_imports`): among them core and worker
  never import each other, with the one way across that `ALLOWED` names: the
  worker reads the scheduler's output types, vllm/v1/core/sched/output.py;
- the modules form no import cycle (between modules, any layer);
- vllm/v1/core reaches no torch through what it imports (runtime imports
  only: a TYPE_CHECKING import of a torch type loads nothing; importing torch
  directly, even for types, is a never-pair).

A failure names the file, the line, both modules and the rule, so the fix is
clear: move the class down (or the import up), or pass the value in from
above. The tests at the end plant imports (in a temporary tree, or as extra
records in the real import graph; nothing under vllm/ is written) to show
that each check can fail.
"""

from __future__ import annotations

import ast
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vllm"

CORE = ("vllm.v1.core", "vllm.v1.request")
WORKER = ("vllm.v1.worker",)
CONNECTORS = ("vllm.distributed.kv_transfer",)
MEMORY = ("vllm.utils.extensible_tensor", "vllm.utils.vmm_reservation")

# Top to bottom. A module may import its own layer and any layer *below* it.
# Prefixes match a module and its submodules ("vllm.v1.core" matches
# "vllm.v1.core.sched.scheduler"); the longest matching prefix wins, so
# "vllm.distributed.kv_transfer" is connectors although "vllm.distributed" is
# allocator, and "vllm.utils.extensible_tensor" is memory although "vllm.utils"
# is utils.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("package", ("vllm",)),  # vllm/__init__.py: lazy public names, nothing imports it
    # vllm.reasoning: the chat frontend's reasoning parsers (text in, text out).
    ("entrypoints", ("vllm.entrypoints", "vllm.benchmarks", "vllm.reasoning")),
    ("engine", ("vllm.engine", "vllm.v1.engine", "vllm.v1.metrics", "vllm.v1.executor")),
    ("worker", WORKER),  # the worker, the model runner, the KV cache object, sizing
    # A KV connector has a scheduler side (it reads the core's requests and
    # blocks) and a worker side (the worker holds it): below the worker, above
    # the core, which names only the protocol it calls (sched/kv_connector.py).
    ("connectors", CONNECTORS),
    ("core", CORE),  # torch-free: the scheduler, the KV cache manager, the block pool
    # Used by both core and worker, so below both: torch-free (numpy at most).
    ("spec_decode", ("vllm.v1.spec_decode",)),
    ("config", ("vllm.config",)),  # resolved from the platform; read by engine and worker
    ("model", (
        "vllm.model_executor", "vllm.attention", "vllm.v1.attention", "vllm.v1.sample",
        "vllm.forward_context", "vllm.v1.kv_cache_interface",
    )),
    ("memory", MEMORY),  # reservations: ExtensibleTensor and what it stands on
    ("allocator", ("vllm.device_allocator", "vllm.platforms", "vllm.distributed")),
    ("utils", ("vllm.utils",)),  # generic helpers: dlpack, argparse, byte ranges
    # Structured outputs' constraint -> grammar -> compile (xgrammar): the frontend
    # validates with it, the engine compiles with it, the worker holds its grammars.
    ("structured_output", ("vllm.v1.structured_output",)),
    # Shared leaves: torch-free types and helpers every layer may use.
    ("foundation", (
        "vllm.envs", "vllm.logger", "vllm.version", "vllm.exceptions", "vllm.inputs",
        "vllm.outputs", "vllm.logprobs", "vllm.sampling_params", "vllm.transformers_utils",
        "vllm.v1.outputs", "vllm.multimodal",
        "vllm.v1",  # the bare namespace package vllm/v1/__init__.py
    )),
]

# (importer prefix, imported prefix, why): the only imports the never-pairs let through.
ALLOWED: list[tuple[str, str, str]] = [
    (worker, "vllm.v1.core.sched.output",
     "SchedulerOutput goes down: the one module of the core the worker reads")
    for worker in WORKER
]

# (importer prefix, imported prefix, why): refused whatever the layers say.
NEVER_PAIRS: list[tuple[str, str, str]] = [
    *((core, worker, "the core never sees the worker: it hands SchedulerOutput down and "
       "gets ModelRunnerOutput back through the engine")
      for core in CORE for worker in (*WORKER, *CONNECTORS)),
    *((worker, core, "the worker never sees the scheduler: it reads only "
       "vllm.v1.core.sched.output") for worker in WORKER for core in CORE),
    *((core, "torch", "the scheduler never touches a tensor: v1/core imports no torch, "
       "not even for a type") for core in CORE),
    *(("vllm.device_allocator", memory, "the VMM driver knows nothing about tensors, "
       "segments or reservations: they stand on it") for memory in MEMORY),
    *((lower, "vllm.v1", "a platform or driver answers device questions; the engine asks, "
       "never the reverse") for lower in ("vllm.platforms", "vllm.device_allocator")),
    ("vllm.v1.kv_cache_interface", "vllm.v1.worker", "allocation once climbed back up "
     "into the worker's helpers: pass the strategy down (reserve=...)"),
]


@dataclass(frozen=True)
class Import:
    importer: str  # module name
    imported: str  # module name, or "torch"
    path: pathlib.Path  # relative to the tree's root
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`

    def where(self) -> str:
        return f"{self.path}:{self.line}: {self.importer} imports {self.imported}" + (
            " (type-only)" if self.type_only else "")


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


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the module's layer (longest prefix), None if it has none."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == "vllm" if prefix == "vllm" else _matches(module, prefix)
            if matches and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def _allowed(imp: Import) -> bool:
    return any(_matches(imp.importer, a) and _matches(imp.imported, b) for a, b, _ in ALLOWED)


def upward_imports(imports: list[Import]) -> list[str]:
    """One message per import that points up the layer order."""
    problems = []
    for imp in imports:
        if imp.imported == "torch":
            continue
        low, high = layer_of(imp.importer), layer_of(imp.imported)
        if low is not None and high is not None and high < low:
            problems.append(
                f"{imp.path}:{imp.line}: {imp.importer} ({LAYERS[low][0]}) imports "
                f"{imp.imported} ({LAYERS[high][0]}), a layer above it"
                f"{' (type-only)' if imp.type_only else ''}"
            )
    return problems


def never_pair_imports(imports: list[Import]) -> list[str]:
    """One message per import that NEVER_PAIRS refuses (and ALLOWED does not name)."""
    problems = []
    for imp in imports:
        if _allowed(imp):
            continue
        for importer, imported, why in NEVER_PAIRS:
            if _matches(imp.importer, importer) and _matches(imp.imported, imported):
                problems.append(f"{imp.where()}: never-pair {importer} -> {imported}: {why}")
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


def test_every_layer_prefix_names_a_module():
    stale = [(name, prefix) for name, prefixes in LAYERS for prefix in prefixes
             if not any(_matches(m, prefix) for m in MODULES)]
    assert not stale, f"prefixes in LAYERS that match no module (remove them): {stale}"


def test_exceptions_and_never_pairs_name_real_modules():
    for importer, imported, _ in ALLOWED + NEVER_PAIRS:
        for prefix in (importer, imported):
            assert prefix == "torch" or any(_matches(m, prefix) for m in MODULES), prefix


def test_imports_point_downward():
    problems = upward_imports(IMPORTS)
    assert not problems, "upward imports (docs/design.md, The layers):\n" + "\n".join(problems)


def test_no_never_pairs():
    problems = never_pair_imports(IMPORTS)
    assert not problems, "never-pairs (tests/test_layers.py NEVER_PAIRS):\n" + "\n".join(problems)


def test_no_import_cycles():
    cycles = find_cycles(IMPORTS)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_core_is_torch_free():
    core = {m for m in MODULES if any(_matches(m, prefix) for prefix in CORE)}
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


def _every_problem(imports: list[Import]) -> set[str]:
    return set(upward_imports(imports) + never_pair_imports(imports))


def _plant(path: str, imported: str, type_only: bool) -> list[str]:
    """What the checks newly report once `path` (a real file) imports `imported`."""
    assert (ROOT / path).is_file() and imported in MODULES, (path, imported)
    planted = Import(module_name(ROOT / path, ROOT), imported, pathlib.Path(path), 1, type_only)
    return sorted(_every_problem(IMPORTS + [planted]) - _every_problem(IMPORTS))


def test_checker_reports_the_worker_named_in_the_scheduler():
    """Issue 44: `if TYPE_CHECKING: from vllm.v1.worker.gpu_worker import Worker` in the
    scheduler passed the old check (core and worker were one layer)."""
    problems = _plant("vllm/v1/core/sched/scheduler.py", "vllm.v1.worker.gpu_worker", True)
    where = ("vllm/v1/core/sched/scheduler.py:1: vllm.v1.core.sched.scheduler imports "
             "vllm.v1.worker.gpu_worker (type-only)")
    assert problems == [
        "vllm/v1/core/sched/scheduler.py:1: vllm.v1.core.sched.scheduler (core) imports "
        "vllm.v1.worker.gpu_worker (worker), a layer above it (type-only)",
        f"{where}: never-pair vllm.v1.core -> vllm.v1.worker: the core never sees the worker: "
        "it hands SchedulerOutput down and gets ModelRunnerOutput back through the engine",
    ]


def test_checker_reports_a_reservation_in_the_vmm_driver():
    """Issue 44: gpu_vmm.py importing vllm.utils.extensible_tensor passed the old check
    (device_allocator and utils were one layer)."""
    problems = _plant("vllm/device_allocator/gpu_vmm.py", "vllm.utils.extensible_tensor", False)
    assert problems == [
        "vllm/device_allocator/gpu_vmm.py:1: vllm.device_allocator.gpu_vmm (allocator) imports "
        "vllm.utils.extensible_tensor (memory), a layer above it",
        "vllm/device_allocator/gpu_vmm.py:1: vllm.device_allocator.gpu_vmm imports "
        "vllm.utils.extensible_tensor: never-pair vllm.device_allocator -> "
        "vllm.utils.extensible_tensor: the VMM driver knows nothing about tensors, segments "
        "or reservations: they stand on it",
    ]


def test_the_allowed_module_crosses_and_nothing_beside_it():
    assert _plant("vllm/v1/worker/gpu_model_runner.py", "vllm.v1.core.sched.output", False) == []
    problems = _plant("vllm/v1/worker/gpu_model_runner.py", "vllm.v1.core.sched.utils", True)
    assert len(problems) == 1
    assert "never-pair vllm.v1.worker -> vllm.v1.core:" in problems[0]


@pytest.mark.parametrize("pair", NEVER_PAIRS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_checker_reports_each_never_pair(pair):
    importer, imported, why = pair
    imp = Import(f"{importer}.planted", f"{imported}.planted", pathlib.Path("x.py"), 3, True)
    assert never_pair_imports([imp]) == [
        f"x.py:3: {importer}.planted imports {imported}.planted (type-only): "
        f"never-pair {importer} -> {imported}: {why}"
    ]


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
    assert "vllm.v1.core.block_pool (core) imports vllm.v1.engine.core (engine)" in problem


def test_checker_reports_a_type_only_worker_to_core_import(tmp_path):
    _, imports = _tree(tmp_path, {
        "vllm/__init__.py": "",
        "vllm/v1/worker/gpu_worker.py": (
            "import typing\nif typing.TYPE_CHECKING:\n    from vllm.v1.request import Request\n"
        ),
        "vllm/v1/request.py": "class Request: ...\n",
    })
    (problem,) = never_pair_imports(imports)
    assert problem.startswith(
        "vllm/v1/worker/gpu_worker.py:3: vllm.v1.worker.gpu_worker imports vllm.v1.request "
        "(type-only): never-pair vllm.v1.worker -> vllm.v1.request"
    )
    assert upward_imports(imports) == []  # the worker is above the core: only the pair says no


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
