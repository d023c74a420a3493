"""The one dependency rule (DESIGN §2), checked on every import statement of every part, lazy ones included.

protocol imports nothing of ours; admission imports protocol; store imports protocol and admission;
client imports protocol and admission and never store, lmdb or aiohttp.web; gpu_staging imports
client and protocol. The one exception is written down in docs/design.md: client/vllm is an engine
adapter at the top of the graph and may import gpu_staging (nothing imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("protocol", "admission", "store", "client", "gpu_staging")
ALLOWED = {
    "protocol": set(),
    "admission": {"protocol"},
    "store": {"protocol", "admission"},
    "client": {"protocol", "admission"},
    "gpu_staging": {"client", "protocol"},
}
EXCEPTIONS = {("client/vllm", "gpu_staging")}
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"aiohttp", "lmdb", "torch", "nixl", "vllm"},
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
