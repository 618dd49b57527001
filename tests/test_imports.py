"""The package's import structure: no import loops (counting imports inside functions too), and the layering rules
of docs/architecture.md (the model never imports Triton, torch.distributed or the Hugging Face code). And the tests':
no test module imports another (shared code lives in plain modules beside them, fixtures in conftest.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import anyseek

ROOT = Path(anyseek.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """anyseek modules that `name` imports anywhere in its file (top level or inside functions)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if t in known and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _package_edges_removed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # a package's __init__ that re-exports its own submodules is not a loop with them
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in graph.items()}


def test_no_import_loops():
    cycles = _cycles(_package_edges_removed(_graph()))
    assert not cycles, "import loops under src/anyseek: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_loop_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_model_imports_neither_triton_distributed_nor_hf():
    for path in (ROOT / "model").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for n in names:
                assert not n.startswith(("triton", "torch.distributed", "anyseek.hf", "transformers")), (
                    f"{path.name} imports {n}")
                assert n not in ("anyseek.train", "anyseek.data") and not n.startswith(("anyseek.train.", "anyseek.data.")), (
                    f"{path.name} imports {n}")


# The packages in layers, lowest first: a module may import its own package and the layers below its own, never one
# beside it or above it. The root package (`anyseek/__init__.py`, lazy exports) and the command line sit on top.
LAYERS = (
    ("constants", "storage", "runtime"),
    ("kernels",),
    ("model",),
    ("data", "hf"),
    ("transforms", "distributed"),
    ("checkpoint",),
    ("infer",),
    ("train",),
    ("cli", "doctor", ""),
    ("__main__",),
)
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _package(module: str) -> str:
    """anyseek.train.step -> train; anyseek.storage -> storage; anyseek -> '' (the root)."""
    return module.split(".")[1] if "." in module else ""


def _layer_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The anyseek modules `name` imports (anywhere in its file), each resolved to the module itself:
    `from anyseek import kernels` is anyseek.kernels, not the root package. `from anyseek import __version__` (the
    root's only eager attribute) counts as no import."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                mod = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in known:
                    out.add(f"{mod}.{a.name}")
                elif mod in known and not (mod == "anyseek" and a.name == "__version__"):
                    out.add(mod)
    return out - {name}


def _layer_violations() -> list[str]:
    mods = _modules()
    bad = []
    for name, path in sorted(mods.items()):
        here = _package(name)
        for target in sorted(_layer_imports(name, path, set(mods))):
            there = _package(target)
            if there == here:
                continue
            if there not in LEVEL or here not in LEVEL:
                bad.append(f"{name} -> {target}: package {there or here!r} has no layer in tests/test_imports.py")
            elif LEVEL[there] >= LEVEL[here]:
                bad.append(f"{name} -> {target}: {here or 'anyseek'} (layer {LEVEL[here]}) may not import "
                           f"{there or 'anyseek'} (layer {LEVEL[there]})")
    return bad


def test_packages_import_only_layers_below():
    bad = _layer_violations()
    assert not bad, "imports that run back up (or across) the package layers:\n" + "\n".join(bad)


def test_layer_rule_catches_an_upward_import(tmp_path, monkeypatch):
    # the rule itself: a file importing a higher layer is reported (a test that cannot fail would pass silently)
    assert _layer_imports("anyseek.model.x", ROOT / "model" / "mla.py", set(_modules())) >= {"anyseek.kernels"}
    fake = tmp_path / "anyseek"
    (fake / "model").mkdir(parents=True)
    (fake / "train").mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "model" / "__init__.py").write_text("")
    (fake / "train" / "__init__.py").write_text("")
    (fake / "train" / "loop.py").write_text("x = 1\n")
    (fake / "model" / "bad.py").write_text("from anyseek.train import loop\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    assert _layer_violations() == ["anyseek.model.bad -> anyseek.train.loop: model (layer 2) may not import train "
                                   "(layer 7)"]


# ---------------------------------------------------------------------------------------------------- the tests
TESTS = Path(__file__).parent


def _test_module_imports(folder: Path) -> list[str]:
    """Imports, anywhere in folder/*.py, of a test module (test_*.py, conftest) or of anything under the name `tests.`:
    either loads a module a second time under another name (pytest imports each test file as its own top-level
    module), fixtures included. Shared code is imported from the plain modules beside the tests (`from helpers
    import ...`), fixtures come from conftest.py without an import."""
    tests = {p.stem for p in folder.glob("test_*.py")} | {"conftest"}
    bad = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in tests | {"tests"}]
    return bad


def test_no_test_module_imports_another():
    bad = _test_module_imports(TESTS)
    assert not bad, ("test modules importing test modules (shared code goes in helpers.py, fixtures in conftest.py):\n"
                     + "\n".join(bad))


def test_test_import_rule_catches_one(tmp_path):
    (tmp_path / "test_a.py").write_text("def helper():\n    pass\n")
    (tmp_path / "test_b.py").write_text("import os\n\n\ndef test_x():\n    from test_a import helper\n")
    (tmp_path / "test_c.py").write_text("from tests.helpers import run\nimport conftest\nfrom helpers import run\n")
    (tmp_path / "helpers.py").write_text("import json\n")
    assert _test_module_imports(tmp_path) == ["test_b.py:5 imports test_a", "test_c.py:1 imports tests.helpers",
                                              "test_c.py:2 imports conftest"]
