"""The one dependency rule (DESIGN §2), checked on every import statement of every part, lazy ones included.

protocol imports nothing of ours; transport (the I/O wing: the frame transport, socket sends, the
streamed body, the nixl agent) imports protocol; admission imports protocol; store imports protocol,
transport and admission; client imports protocol, transport and admission and never store, lmdb or
aiohttp.web; gpu_staging imports client and protocol. The one exception is written down in docs/design.md: client/vllm is an engine
adapter at the top of the graph and may import gpu_staging (nothing imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("protocol", "transport", "admission", "store", "client", "gpu_staging")
ALLOWED = {
    "protocol": set(),
    "transport": {"protocol"},
    "admission": {"protocol"},
    "store": {"protocol", "transport", "admission"},
    "client": {"protocol", "transport", "admission"},
    "gpu_staging": {"client", "protocol"},
}
EXCEPTIONS = {("client/vllm", "gpu_staging")}
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"aiohttp", "lmdb", "torch", "nixl", "vllm"},
    "transport": {"aiohttp", "lmdb", "torch", "vllm"},  # asyncio only; nixl lazily, in nixl_agent.py
    "admission": {"aiohttp", "lmdb", "torch", "nixl", "vllm"},
    "client": {"lmdb", "aiohttp.web"},
}


def _imports(path: Path) -> list[tuple[str, int]]:
    """(target, line) for every import: a part of ours by name, or a third-party module's dotted name."""
    rel = path.relative_to(ROOT)
    package = list(rel.parts[:-1])
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module or ""
                out.append((module, node.lineno))
                if module == "aiohttp":  # `from aiohttp import web`
                    out += [(f"aiohttp.{a.name}", node.lineno) for a in node.names]
                continue
            base = package[: len(package) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            name = target[0] if target else (node.names[0].name if node.names else "")
            out.append((f"ours:{name}", node.lineno))
    return out


def _files() -> list[Path]:
    return sorted(p for part in PARTS for p in (ROOT / part).rglob("*.py"))


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_dependency_rule(path: Path) -> None:
    rel = path.relative_to(ROOT)
    part = rel.parts[0]
    where = "/".join(rel.parts[:2]) if len(rel.parts) > 2 else part
    for target, line in _imports(path):
        if target.startswith("prefixstore."):
            target = "ours:" + target.split(".")[1]
        if target.startswith("ours:"):
            other = target[5:]
            if other in (part, "prefixstore") or other not in PARTS:
                continue
            assert other in ALLOWED[part] or (where, other) in EXCEPTIONS, \
                f"{rel}:{line}: {part} must not import {other} (DESIGN §2)"
        else:
            for banned in FORBIDDEN_THIRD_PARTY.get(part, ()):
                assert not (target == banned or target.startswith(banned + ".")), \
                    f"{rel}:{line}: {part} must not import {banned}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The parser resolves relative imports to parts: an upward import is seen as one."""
    fake = ROOT / "protocol" / "_layers_probe.py"
    fake.write_text("def f():\n    from ..store import core\n    import lmdb\n")
    try:
        found = dict(_imports(fake))
        assert found.get("ours:store") == 2 and found.get("lmdb") == 3
        with pytest.raises(AssertionError, match="protocol must not import store"):
            test_imports_follow_the_dependency_rule(fake)
    finally:
        fake.unlink()


# ---------------------------------------------------------------- the module graph

ALL_PARTS = PARTS + ("prefixstore",)


def _module_of(path: Path) -> str:
    """'store/core.py' -> 'store.core'; a package's __init__ is the package itself."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _source_files() -> list[Path]:
    return sorted(p for part in ALL_PARTS for p in (ROOT / part).rglob("*.py") if "_layers_probe" not in p.name)


def _known_modules() -> set[str]:
    return {_module_of(p) for p in _source_files()}


def _resolve(path: Path, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[tuple[str, list[str]]]:
    """(module of ours it names, names taken from it) for each of our modules an import statement reaches."""
    here = _module_of(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out: list[tuple[str, list[str]]] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name.removeprefix("prefixstore.") if alias.name.startswith("prefixstore.") else alias.name
            if name in known:
                out.append((name, []))
        return out
    if node.level == 0:
        if not (node.module or "").startswith("prefixstore."):
            return out
        base = node.module.removeprefix("prefixstore.").split(".")  # type: ignore[union-attr]
    else:
        base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    mod = ".".join(base)
    names = [a.name for a in node.names]
    for n in names:  # `from . import admin`: the submodule
        sub = f"{mod}.{n}" if mod else n
        if sub in known:
            out.append((sub, []))
    if mod in known:
        out.append((mod, [n for n in names if f"{mod}.{n}" not in known]))
    return out


def _graph() -> dict[str, dict[str, list[str]]]:
    known = _known_modules()
    graph: dict[str, dict[str, list[str]]] = {}
    for path in _source_files():
        me = _module_of(path)
        edges = graph.setdefault(me, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, names in _resolve(path, node, known):
                    if target != me:
                        edges.setdefault(target, []).extend(names)
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_face(a: str, b: str) -> bool:
    """A package's __init__ re-exporting its own submodule: that edge is the package's face."""
    return b.startswith(a + ".")


def test_no_import_cycles_between_modules() -> None:
    """Every import statement counts, lazy ones too: a cycle held together by a function-level
    import is still two modules that cannot be understood apart (house issue)."""
    graph = _graph()
    faceless = {a: {b: n for b, n in edges.items() if not _is_package_face(a, b)} for a, edges in graph.items()}
    assert _cycles(faceless) == []


def test_no_private_name_crosses_a_module_boundary() -> None:
    """`from .x import _y` and `x._y` on an imported module of ours are refused: a module that needs
    another's private name needs a public seam."""
    known = _known_modules()
    bad: list[str] = []
    for path in _source_files():
        tree = ast.parse(path.read_text(), str(path))
        ours_aliases: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target, names in _resolve(path, node, known):
                    bad += [f"{path.relative_to(ROOT)}:{node.lineno}: {n} from {target}"
                            for n in names if n.startswith("_") and not n.startswith("__")]
                if isinstance(node, ast.ImportFrom):
                    for a in node.names:
                        if any(t.endswith(f".{a.name}") or t == a.name for t, _ in _resolve(path, node, known)):
                            ours_aliases.add(a.asname or a.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ours_aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert bad == []


def test_the_cycle_checker_sees_a_cycle() -> None:
    assert _cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]
