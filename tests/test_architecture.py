"""The architecture, checked: no import cycle (imports inside functions included), the compiled kernels only in
iclab.ops, the backend a run option and never a config field, and the layer contracts of pyproject.toml."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import iclab

PACKAGE = Path(iclab.__file__).parent
SRC = PACKAGE.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every iclab module ``name`` imports, anywhere in its file: ``from a import b`` counts as a.b where that is a
    module, else as a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_bytes())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in out if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules that import themselves."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_iclabs_modules():
    modules = _modules()
    graph = {name: _imports(name, path, modules) - {"iclab"} for name, path in modules.items()}
    # (every module imports the root package for __version__ or its settings; the root imports threads and errors)
    assert len(graph) > 100 and graph["iclab.launch"] >= {"iclab.runner", "iclab.shards"}  # the walk sees imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_compiled_kernels_live_only_in_ops():
    """llvmlite, numba, ctypes and JAX's private modules are named in no file of iclab outside iclab/ops."""
    words = ("llvmlite", "numba", "ctypes", "jax._src")
    found = [f"{p.relative_to(SRC)}: {w}" for p in PACKAGE.rglob("*.py") if "ops" not in p.relative_to(PACKAGE).parts
             for w in words if w in p.read_text()]
    assert found == []
    assert any("numba" in p.read_text() for p in (PACKAGE / "ops").rglob("*.py"))  # the scan reads the files


def test_the_backend_is_a_run_option_not_a_config_field():
    from iclab.experiments import all_experiments

    fields = {(e.id, name) for e in all_experiments().values() for name in e.config.model_fields
              if name in ("kernel", "sampler", "normals", "backend", "moments_backend")}
    assert fields == set()


@pytest.mark.skipif(shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None,
                    reason="import-linter is not installed (the test extra installs it)")
def test_the_layer_contracts_hold():
    """pyproject.toml's import-linter contracts (the layers, ops importing nothing above, experiments away from ops
    and from lower layers' private modules, theory training nothing, the papers independent)."""
    exe = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(exe)], cwd=SRC.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout
