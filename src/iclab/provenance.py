"""What code computed a run: the code identity that keys the result store together with the config.

A stored run is reused only when its experiment id, resolved config, iclab version and code identity
all equal the new run's (:func:`run_key`), so an edited experiment or engine computes again instead of
serving a result of the old code. The identity is a digest over source files:

- **iclab's own files that the experiment can reach.** Starting from the modules that define the
  experiment (its ``run``, ``checks``, ``plot``, config class, shard functions), every iclab module they
  import, directly or through others, is followed in the *static* import graph: every ``import`` and
  ``from ... import`` statement in a file, those inside functions included, and the ``__init__.py`` of
  every package on the way. Editing an engine changes the identity of every experiment that imports it
  and of no other; a README, docs or test change changes nothing. (A module reached only by a computed
  ``importlib.import_module(name)`` is not followed; iclab's experiments do not compute through one.)
- **a user's experiment file** (``iclab run path/to/file.py:NAME``): its absolute path and SHA-256, the
  files beside it that it imports (a sibling ``helpers.py``), and the iclab files it reaches as above.
  Two files that declare the same experiment id never share results.
- **an experiment defined where no file holds it** (a notebook cell): the source text of its functions
  (``inspect.getsource``), else their bytecode.
- **the registered extensions a config uses** (``Experiment.extensions``, e.g. a drift family of one's own
  that ``lab.drift_families`` runs by name): the files that define their functions (SHA-256 by absolute path,
  with the files beside them that they import and the iclab files they reach), the source of those defined
  where no file holds them, and their other values (``repr``). The experiment's own code does not change when
  a user edits the family it runs by name; this part of the key does.

The versions of iclab's dependencies (jax, numpy, ...) are recorded beside the identity
(:func:`environment_versions`) but do not enter it: another jaxlib may change the last bits of a float,
and recomputing every stored result for it would throw away a store on every upgrade.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import marshal
import re
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import Path

__all__ = ["code_identity", "config_key", "describe_change", "environment_versions", "file_sha256", "run_key"]

#: The folder of the iclab package (``.../iclab``); files are named relative to its parent (``iclab/x.py``).
PACKAGE_DIR = Path(__file__).resolve().parent
_TOP = PACKAGE_DIR.parent


def file_sha256(path: str | Path) -> str:
    """The SHA-256 (hex) of a file's bytes.

    Args:
        path: the file.
    """
    return _digest_of(str(Path(path).resolve()), *_stamp(Path(path)))


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=4096)
def _digest_of(path: str, mtime_ns: int, size: int) -> str:
    # keyed by (path, mtime, size): a file edited in this process is hashed again
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


#: An import statement at the start of a line (inside functions too): ``from M import N`` (names possibly in
#: parentheses over several lines) or ``import M``. A text scan, not a parse: much faster than ``ast`` over the
#: package, and an import-like line inside a docstring only adds a file (a key that changes too often,
#: never one that misses a change).
_IMPORT = re.compile(rb"^[ \t]*(?:from[ \t]+([.\w]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n#;]*)|import[ \t]+([^\n#;]+))",
                     re.M)


_COMMENT = re.compile(rb"#[^\n]*")


@lru_cache(maxsize=4096)
def _imports_of(path: str, mtime_ns: int, size: int) -> tuple[tuple[str, int, tuple[str, ...]], ...]:
    """Every import statement of a file as (module, level, names): ``import a.b`` is ("a.b", 0, ()),
    ``from .x import y, z`` is ("x", 1, ("y", "z"))."""
    try:
        text = _COMMENT.sub(b"", Path(path).read_bytes().replace(b"\\\n", b" "))
    except OSError:
        return ()
    out = []
    for m in _IMPORT.finditer(text):
        if m.group(1) is not None:
            module = m.group(1).decode(errors="replace")
            level = len(module) - len(module.lstrip("."))
            names = m.group(2).decode(errors="replace").strip("() \t\r\n")
            out.append((module.lstrip("."), level, tuple(_bare(n) for n in names.split(",") if _bare(n))))
        else:
            out += [(_bare(n), 0, ()) for n in m.group(3).decode(errors="replace").split(",") if _bare(n)]
    return tuple(out)


def _bare(text: str) -> str:
    """``a.b as c`` -> ``a.b`` (an empty string for what is not a dotted name)."""
    name = text.split(" as ")[0].strip()
    return name if name and all(part.isidentifier() for part in name.split(".")) else ""


def _module_file(name: str) -> Path | None:
    """The source file of an iclab module name (``iclab.a.b`` -> ``.../iclab/a/b.py`` or ``.../b/__init__.py``)."""
    parts = name.split(".")
    if parts[0] != "iclab":
        return None
    base = _TOP.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str | None:
    """The iclab module name of a file inside the package (None outside it)."""
    try:
        rel = path.resolve().relative_to(_TOP)
    except ValueError:
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) if parts and parts[0] == "iclab" else None


def _resolve(module: str, level: int, package: str) -> str:
    if level == 0:
        return module
    base = package.split(".")
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def _reached(start: list[Path], sibling_dir: Path | None = None) -> tuple[dict[str, Path], dict[str, Path]]:
    """iclab files and sibling files reached from ``start`` in the static import graph.

    Returns:
        ({"iclab/x/y.py": path}, {"helpers.py": path}) -- the second for files in ``sibling_dir``.
    """
    package_files: dict[str, Path] = {}
    siblings: dict[str, Path] = {}
    todo = list(start)
    seen: set[Path] = set()

    def add_module(name: str) -> None:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # a module and every package above it
            f = _module_file(".".join(parts[:i]))
            if f is not None and f not in seen:
                todo.append(f)

    while todo:
        path = todo.pop().resolve()
        if path in seen:
            continue
        seen.add(path)
        name = _module_name(path)
        if name is not None:
            package_files[str(path.relative_to(_TOP))] = path
        elif sibling_dir is not None and path.parent == sibling_dir and path not in start:
            siblings[path.name] = path
        is_package = path.name == "__init__.py"
        package = name if (name and is_package) else (name.rpartition(".")[0] if name else "")
        for module, level, names in _imports_of(str(path), *_stamp(path)):
            if level and not name:
                continue  # a relative import in a user's file: not a package, nothing to follow
            full = _resolve(module, level, package)
            if full.split(".")[0] == "iclab":
                add_module(full)
                for n in names:  # ``from iclab.tasks import linreg``: linreg may be a module
                    if _module_file(f"{full}.{n}") is not None:
                        add_module(f"{full}.{n}")
            elif level == 0 and sibling_dir is not None:
                top = full.split(".")[0]
                for candidate in (sibling_dir / f"{top}.py", sibling_dir / top / "__init__.py"):
                    if candidate.is_file() and candidate.resolve() not in seen:
                        todo.append(candidate)
    return package_files, siblings


def _function_source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        code = getattr(obj, "__code__", None)
        return marshal.dumps(code).hex() if code is not None else repr(obj)


def _defining_objects(exp) -> list:
    names = ("run", "checks", "plot", "preflight", "memory", "shards", "run_shard", "assemble")
    objs = [getattr(exp, n) for n in names if getattr(exp, n, None) is not None]
    return objs + [exp.config]


def code_identity(exp, user_file: str | Path | None = None, *, config=None) -> dict:
    """The code identity of an experiment (module docstring).

    Args:
        exp: the :class:`iclab.experiments.Experiment`.
        user_file: the file it was loaded from (``iclab run path/to/file.py:NAME``), None for iclab's own
            experiments and for experiments defined in a notebook.
        config: the resolved config the identity is for: with it, the registered extensions it uses
            (``exp.extensions(config)``) enter the identity; None: the experiment's code alone.
    Returns:
        {"digest": 16 hex digits, "iclab": version, "files": {"iclab/...py": sha256[:16]}, and for a user
        file "user_file": {"path", "sha256"}, "siblings": {"name.py": sha256[:16]}; for code held by no file
        "inline": sha256[:16] of its functions' source; for one defined in a script or test module "scripts":
        {absolute path: sha256[:16]}; for a config using registered extensions "extensions": {"files":
        {absolute path: sha256[:16]}, "values": sha256[:16] of their values and of source held by no file}}.
    """
    from iclab import __version__

    start: list[Path] = []
    inline: list[str] = []
    sibling_dir = None
    if user_file is not None:
        user_path = Path(user_file).resolve()
        start.append(user_path)
        sibling_dir = user_path.parent
    for obj in _defining_objects(exp):
        module = sys.modules.get(getattr(obj, "__module__", "") or "")
        file = getattr(module, "__file__", None)
        if file and Path(file).is_file() and (user_file is None or _module_name(Path(file)) is not None
                                              or Path(file).resolve() == Path(user_file).resolve()):
            start.append(Path(file))
        elif user_file is None:
            inline.append(_function_source(obj))
    package_files, siblings = _reached(start, sibling_dir)
    extensions = _extensions_identity(exp.extensions(config) if config is not None and getattr(
        exp, "extensions", None) is not None else [], package_files)
    identity: dict = {"iclab": __version__,
                      "files": {k: file_sha256(p)[:16] for k, p in sorted(package_files.items())}}
    others = sorted({str(p.resolve()) for p in start if _module_name(p) is None
                     and (user_file is None or p.resolve() != Path(user_file).resolve())})
    if others:  # an experiment defined in a script or a test module: those files, by absolute path
        identity["scripts"] = {p: file_sha256(p)[:16] for p in others}
    if user_file is not None:
        identity["user_file"] = {"path": str(Path(user_file).resolve()), "sha256": file_sha256(user_file)}
        identity["siblings"] = {k: file_sha256(p)[:16] for k, p in sorted(siblings.items())}
    if inline:
        identity["inline"] = hashlib.sha256("\n".join(inline).encode()).hexdigest()[:16]
    if extensions:
        identity["extensions"] = extensions
    identity["digest"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return identity


def _callables_and_values(obj) -> tuple[list, list[str]]:
    """The functions an extension object holds (itself, a dataclass's fields, a partial's function) and the
    ``repr`` of its other values."""
    import dataclasses
    import functools

    if isinstance(obj, functools.partial):
        inner, values = _callables_and_values(obj.func)
        more = [_callables_and_values(v) for v in (*obj.args, *obj.keywords.values())]
        return inner + [f for c, _ in more for f in c], values + [v for _, vs in more for v in vs]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fns, values = [], [f"{type(obj).__module__}.{type(obj).__qualname__}"]
        for f in dataclasses.fields(obj):
            c, v = _callables_and_values(getattr(obj, f.name))
            fns += c
            values += [f"{f.name}={x}" for x in v]
        return fns, values
    if callable(obj) and hasattr(obj, "__code__"):
        return [obj], []
    return [], [repr(obj)]


def _extensions_identity(objects: list, package_files: dict[str, Path]) -> dict:
    """The identity of registered extensions (module docstring); adds the iclab files they reach to
    ``package_files``; {} when there are none."""
    if not objects:
        return {}
    files: dict[str, str] = {}
    held: list[str] = []
    for obj in objects:
        fns, values = _callables_and_values(obj)
        held += values
        for fn in fns:
            module = sys.modules.get(getattr(fn, "__module__", "") or "")
            file = getattr(module, "__file__", None)
            if file and Path(file).is_file():
                path = Path(file).resolve()
                reached, beside = _reached([path], None if _module_name(path) else path.parent)
                package_files.update(reached)
                if _module_name(path) is None:
                    files[str(path)] = file_sha256(path)[:16]
                    files.update({str(p.resolve()): file_sha256(p)[:16] for p in beside.values()})
            else:
                held.append(_function_source(fn))
    return {"files": dict(sorted(files.items())),
            "values": hashlib.sha256("\n".join(held).encode()).hexdigest()[:16]}


def run_key(experiment_id: str, config: dict, *, version: str, code: str, backend: str) -> str:
    """The key of a stored run: 16 hex digits of SHA-256 over the experiment id, resolved config, iclab version,
    code identity digest and backend. Its run folder is ``<experiment>-<key>``.

    The backend enters the key because its numbers differ: the compiled kernels and XLA agree to float rounding,
    and where a compiled sampler draws the prompts, it draws them from another generator.

    Args:
        experiment_id: the experiment; config: the resolved config (JSON types).
        version: iclab's version; code: :func:`code_identity`'s digest; backend: ``native`` or ``xla``.
    """
    payload = json.dumps({"experiment": experiment_id, "config": config, "version": version, "code": code,
                          "backend": backend}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def config_key(experiment_id: str, config: dict) -> str:
    """16 hex digits of SHA-256 over the experiment id and resolved config alone: runs of one config by
    different code share it, which is how a rerun finds the result it could not reuse and says why.

    Args:
        experiment_id: the experiment; config: the resolved config (JSON types).
    """
    payload = json.dumps({"experiment": experiment_id, "config": config}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def describe_change(old: dict | None, new: dict) -> str:
    """What differs between two code identities, in one clause (for "not reused: ..." messages).

    Args:
        old: the stored run's identity (None or partial for runs stored before identities were recorded);
        new: this run's.
    """
    if not isinstance(old, dict) or "files" not in old:
        return "it was stored by an iclab that did not record its code"
    parts = []
    if old.get("iclab") != new.get("iclab"):
        parts.append(f"iclab {old.get('iclab')} → {new.get('iclab')}")
    ou, nu = old.get("user_file") or {}, new.get("user_file") or {}
    if ou.get("path") != nu.get("path"):
        parts.append(f"another experiment file ({ou.get('path')})")
    elif ou.get("sha256") != nu.get("sha256"):
        parts.append(f"{Path(nu.get('path', 'the experiment file')).name} was edited")
    for kind in ("files", "siblings", "scripts"):
        a, b = old.get(kind) or {}, new.get(kind) or {}
        changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        if changed:
            shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
            parts.append(f"changed: {shown}")
    if old.get("inline") != new.get("inline"):
        parts.append("the experiment's functions changed")
    oe, ne = (x if isinstance(x, dict) else {} for x in (old.get("extensions"), new.get("extensions")))
    if oe != ne:
        of, nf = (x if isinstance(x, dict) else {} for x in (oe.get("files"), ne.get("files")))
        edited = sorted(Path(str(k)).name for k in set(of) | set(nf) if of.get(k) != nf.get(k))
        parts.append("a registered extension it uses changed" + (f" ({', '.join(edited[:4])})" if edited else ""))
    return "; ".join(parts) or "its code identity differs"


def environment_versions() -> dict[str, str]:
    """The installed versions of the packages that compute (recorded with every run, not part of its key)."""
    out = {"python": sys.version.split()[0]}
    try:
        requirements = metadata.requires("iclab") or []
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        requirements = []
    for req in requirements:
        if "extra ==" in req:  # optional dependencies: only those installed are recorded, below
            continue
        name = re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0].strip()
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    for optional in ("torch", "transformers"):  # the llm extra, when installed
        try:
            out[optional] = metadata.version(optional)
        except metadata.PackageNotFoundError:
            pass
    return out
