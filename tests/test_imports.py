"""The package's import graph, read from the source (AST), lazy imports inside functions included.

Three rules (README, Layout): no circle between files; ``post/`` imports nothing of the top level (the API
modules and ``view/``: what it returns is drawn by its caller); and no module reaches into another's
underscored names, neither by ``from x import _name`` nor by ``import x; x._name``. An import under
``if TYPE_CHECKING:`` (annotations only) is no edge.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "megatrain_nb"
PKG = ROOT.name
TOP = {f"{PKG}.{p.stem}" for p in ROOT.glob("*.py") if p.stem != "__init__"} | {PKG, f"{PKG}.view"}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT.parent).with_suffix("").parts)
        pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if pkg else parts)] = (p, pkg)
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The package module a dotted name lives in (the longest prefix that is a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under an ``if TYPE_CHECKING:`` (annotation-only imports)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            out |= {id(c) for c in ast.walk(n)}
    return out


def _imports(module: str):
    """Yield (line, target module, imported name or None, local name bound) for each package import in ``module``."""
    path, is_pkg = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_nodes(tree)
    here = module if is_pkg else module.rpartition(".")[0]
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == PKG:
                    yield n.lineno, _owner(a.name), None, a.asname or a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = here.split(".")[:len(here.split(".")) - (n.level - 1)]
                src = ".".join(base + ([n.module] if n.module else []))
            else:
                src = n.module or ""
            if src.split(".")[0] != PKG:
                continue
            for a in n.names:
                full = f"{src}.{a.name}"
                if full in MODULES:  # a module imported by name
                    yield n.lineno, full, None, a.asname or a.name
                else:
                    yield n.lineno, _owner(src), a.name, a.asname or a.name


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: first line}, self-imports and package-to-own-submodule re-exports kept."""
    g: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    for m in MODULES:
        for line, target, _, _ in _imports(m):
            if target and target != m:
                g[m].setdefault(target, line)
    return g


def _cycles(g: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(g[root]))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(g[w])))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_graph_is_read():
    """The reader sees the package's known edges, lazy ones included, so the rules below test something."""
    g = _graph()
    assert len(MODULES) > 50
    assert f"{PKG}.step.engine" in g[f"{PKG}.session"]
    assert f"{PKG}.step.decode" in g[f"{PKG}.inference"]  # a lazy import inside generate
    assert f"{PKG}.step.between_steps" in g[f"{PKG}.step.decode"]
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_no_import_circles():
    g = _graph()
    bad = []
    for comp in _cycles(g):
        bad.append(comp + [f"{a} -> {b} (line {g[a][b]})" for a in comp for b in g[a] if b in comp])
    assert not bad, f"import circles between files: {bad}"


def test_post_imports_nothing_of_the_top_level():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith(f"{PKG}.post")
           for line, t, _, _ in _imports(m) if t in TOP or (t or "").startswith(f"{PKG}.view")]
    assert not bad, f"post/ reaches up (pass a callback or return data instead): {bad}"


def test_no_module_uses_another_modules_underscored_names():
    bad = []
    for m, (path, _) in MODULES.items():
        modules_bound = {}
        for line, target, name, local in _imports(m):
            if target is None or target == m:
                continue
            if name is None:
                modules_bound[local] = target
            elif name.startswith("_") and not name.startswith("__"):
                bad.append(f"{m}:{line} imports {target}.{name}")
        tree = ast.parse(path.read_text())
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in modules_bound
                    and n.attr.startswith("_") and not n.attr.startswith("__")):
                bad.append(f"{m}:{n.lineno} uses {modules_bound[n.value.id]}.{n.attr}")
    assert not bad, f"underscored names used across modules (make them public or move the job): {bad}"


@pytest.mark.parametrize("rule", ["circle", "post", "underscore"])
def test_the_rules_catch_a_planted_violation(rule, tmp_path, monkeypatch):
    """Each rule fails on a violation planted in a copy of the graph's input, so none passes vacuously."""
    a, b = f"{PKG}.post.zz_a", f"{PKG}.step.zz_b"
    src = {"circle": (f"from ..step import zz_b\n", "def f():\n    from ..post import zz_a\n"),
           "post": ("def f():\n    from ..training import train\n", ""),
           "underscore": ("from ..step.zz_b import _hidden\n", "_hidden = 1\n")}[rule]
    (tmp_path / "a.py").write_text(src[0])
    (tmp_path / "b.py").write_text(src[1])
    monkeypatch.setitem(MODULES, a, (tmp_path / "a.py", False))
    monkeypatch.setitem(MODULES, b, (tmp_path / "b.py", False))
    check = {"circle": test_no_import_circles, "post": test_post_imports_nothing_of_the_top_level,
             "underscore": test_no_module_uses_another_modules_underscored_names}[rule]
    with pytest.raises(AssertionError):
        check()
