"""The package as users install and import it: one top-level `pdserve`, no import circles
(function-level imports included), a docstring on every router sub-package, every router
module in docs/architecture.md's concern table, and a router process free of torch."""
from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pdserve"
PARTS = ("prefill_node", "decode_node", "kv_transfer", "router", "common", "kernels")


def test_only_pdserve_is_installed_at_the_top():
    dist = importlib.metadata.distribution("pdserve")
    assert dist.read_text("top_level.txt").split() == ["pdserve"]
    for name in PARTS:  # a generic top-level name, if importable at all, is someone else's
        spec = importlib.util.find_spec(name)
        assert spec is None or PACKAGE not in Path(spec.origin or "/").resolve().parents, name


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_circle():
    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")]:
        graph.add_import(importer=a, imported=b)
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_two_modules_import_each_other():
    """grimp reads every import statement, function-level ones included."""
    assert _cycles(grimp.build_graph("pdserve", cache_dir=None)) == []


def _router_packages() -> list[Path]:
    return sorted(p.parent for p in (PACKAGE / "router").glob("*/__init__.py"))


def test_every_router_subpackage_names_its_concern():
    packages = _router_packages()
    assert len(packages) >= 8
    for pkg in packages:
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and len(doc.split(".")[0]) > 20, f"{pkg.name}/__init__.py has no docstring naming its concern"


def test_architecture_table_lists_every_router_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"router/([\w/]+\.py)", text))
    modules = {str(p.relative_to(PACKAGE / "router")) for p in (PACKAGE / "router").rglob("*.py")
               if p.name != "__init__.py"}
    assert modules - listed == set()


# The modules a router process runs: every command's parser, `serve` / `router`, the router
# core, the OpenAI server and the pools. torch is a worker's import (~3 s of start-up, ~185 MB
# resident); a router never computes with it.
ROUTER_PROCESS = ("pdserve.router.cli.main", "pdserve.router.cli.serve", "pdserve.router.deploy.local",
                  "pdserve.router.core.router", "pdserve.router.core.zmq_frontend", "pdserve.router.openai.server",
                  "pdserve.router.pools.control", "pdserve.router.planner")


def test_a_router_process_does_not_import_torch():
    code = ("import importlib, sys\n"
            f"for name in {ROUTER_PROCESS!r}:\n"
            "    importlib.import_module(name)\n"
            "    assert 'torch' not in sys.modules, name + ' imports torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
