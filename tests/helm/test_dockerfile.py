"""The Dockerfile, parsed by Docker's own parser (the `dockerfile` package wraps BuildKit's).

No Docker engine runs here, so the image is not built; what can be checked
without one is: the instructions (non-root numeric USER, the `prefixstore
serve` entrypoint, the exposed port, no torch or nixl unless asked), that
every COPY source exists and is not excluded by .dockerignore, and that the
HEALTHCHECK command itself passes against a live store and fails against a
dead port.
"""

from __future__ import annotations

import fnmatch
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dockerfile
import pytest

from ..serve_process import clean_env, serving
from .chart import ROOT, render, store_container

DOCKERFILE = ROOT / "Dockerfile"


@pytest.fixture(scope="module")
def commands() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def final_stage(commands: list[dockerfile.Command]) -> list[dockerfile.Command]:
    starts = [i for i, c in enumerate(commands) if c.cmd == "FROM"]
    return commands[starts[-1]:]


def one(commands: list[dockerfile.Command], cmd: str) -> dockerfile.Command:
    found = [c for c in commands if c.cmd == cmd]
    assert len(found) == 1, f"{cmd}: {found}"
    return found[0]


def test_runtime_stage_is_slim_python_and_runs_the_store_as_non_root(commands: list[dockerfile.Command]) -> None:
    stages = [c for c in commands if c.cmd == "FROM"]
    assert len(stages) == 2  # build (with a compiler) and runtime (without)
    final = final_stage(commands)
    assert [stage.value[0] for stage in stages] == ["${PYTHON_IMAGE}", "${PYTHON_IMAGE}"]  # one base, both stages
    user = one(final, "USER").value[0]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so Kubernetes' runAsNonRoot can verify it
    entry = one(final, "ENTRYPOINT")
    assert entry.json and list(entry.value) == ["prefixstore", "serve"]
    cmd = one(final, "CMD")
    assert cmd.json and "--host" in cmd.value and cmd.value[cmd.value.index("--host") + 1] == "0.0.0.0"
    assert one(final, "EXPOSE").value == ("8077",)
    # The USER comes before ENTRYPOINT, and nothing after it switches back.
    names = [c.cmd for c in final]
    assert names.index("USER") < names.index("ENTRYPOINT")


def test_image_user_matches_the_chart(commands: list[dockerfile.Command]) -> None:
    uid, gid = one(final_stage(commands), "USER").value[0].split(":")
    pod = render().one("StatefulSet")["spec"]["template"]["spec"]["securityContext"]
    assert (pod["runAsUser"], pod["runAsGroup"], pod["fsGroup"]) == (int(uid), int(gid), int(gid))
    assert store_container(render())["ports"][0]["containerPort"] == 8077


def test_extras_are_a_build_arg_and_empty_by_default(commands: list[dockerfile.Command]) -> None:
    args = [c.value[0] for c in commands if c.cmd == "ARG"]
    assert 'EXTRAS=""' in args or "EXTRAS=" in args
    install = [c for c in commands if c.cmd == "RUN" and "pip install" in c.value[0] and "EXTRAS" in c.value[0]]
    assert len(install) == 1 and '".${EXTRAS:+[$EXTRAS]}"' in install[0].value[0]
    text = DOCKERFILE.read_text()
    assert "torch" not in " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    assert "nixl" not in " ".join(c.value[0] for c in commands if c.cmd == "RUN")
    assert "--build-arg EXTRAS=gpu" in text  # documented


def _ignored(rel: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns this repository uses (no '!' exceptions)."""
    hit = False
    for pattern in patterns:
        p = pattern.lstrip("/")
        if fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p + "/*") or (
                p.startswith("**/") and (fnmatch.fnmatch(rel, p[3:]) or fnmatch.fnmatch(rel, "*/" + p[3:]))):
            hit = True
    return hit


def test_copy_sources_exist_and_are_in_the_build_context(commands: list[dockerfile.Command]) -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # _ignored does not implement exceptions
    copies = [c for c in commands if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags)]
    sources = [s for c in copies for s in c.value[:-1]]
    assert {"pyproject.toml", "setup.py", "README.md"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such file"
        assert not _ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"
    # Every package directory the project installs is copied (pyproject's package-dir).
    import tomllib

    package_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= set(sources), package_dirs - set(sources)
    # And what must stay out does: tests, local builds, the git directory.
    for rel in (".git", "tests", "helm", "protocol/_chain.cpython-311-x86_64-linux-gnu.so", "store/__pycache__"):
        assert _ignored(rel, patterns), rel


def _healthcheck_argv(commands: list[dockerfile.Command]) -> list[str]:
    hc = one(final_stage(commands), "HEALTHCHECK")
    assert hc.value[0] == "CMD" and hc.json  # exec form: no shell needed in the image
    assert {f.split("=")[0] for f in hc.flags} >= {"--interval", "--timeout", "--start-period", "--retries"}
    return list(hc.value[1:])


@pytest.fixture(scope="module")
def live_port() -> Iterator[int]:
    with serving() as serve:
        proc = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "1MiB", "--page-bytes", "4096")
        assert proc.url is not None
        yield int(proc.url.rsplit(":", 1)[1])


def _run_healthcheck(argv: list[str], **env: str) -> int:
    assert argv[0] == "python" and "/healthz" in argv[-1]
    return subprocess.run([sys.executable, *argv[1:]], env=clean_env(**env), capture_output=True,
                          timeout=30).returncode


def test_healthcheck_passes_on_a_live_store_and_fails_on_a_dead_port(commands: list[dockerfile.Command],
                                                                    live_port: int) -> None:
    argv = _healthcheck_argv(commands)
    assert _run_healthcheck(argv, PREFIXSTORE_PORT=str(live_port)) == 0
    assert _run_healthcheck(argv, PREFIXSTORE_HEALTHCHECK_URL=f"http://127.0.0.1:{live_port}/healthz") == 0
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    assert _run_healthcheck(argv, PREFIXSTORE_PORT=str(dead)) != 0
    assert _run_healthcheck(argv, PREFIXSTORE_HEALTHCHECK_URL=f"http://127.0.0.1:{live_port}/nothing-here") != 0


def test_the_chart_points_the_image_healthcheck_at_the_configured_port() -> None:
    env = {e["name"]: e.get("value") for e in store_container(render({"config": {"port": 9100}}))["env"]}
    assert env["PREFIXSTORE_HEALTHCHECK_URL"] == "http://127.0.0.1:9100/healthz"


# ---------------------------------------------------------------- pinned as tested

CONSTRAINTS = ROOT / "constraints.txt"


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!]*)", line)
            assert m, f"constraints.txt: {line!r} is not an exact pin (name==version)"
            assert _name(m.group(1)) not in pins, f"constraints.txt: {m.group(1)} pinned twice"
            pins[_name(m.group(1))] = m.group(2)
    return pins


def _pyproject() -> dict[str, Any]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_base_image_is_pinned_by_digest_and_pip_by_version(commands: list[dockerfile.Command]) -> None:
    args = dict(c.value[0].split("=", 1) for c in commands if c.cmd == "ARG" and "=" in c.value[0])
    first_from = next(i for i, c in enumerate(commands) if c.cmd == "FROM")
    assert any(c.cmd == "ARG" and c.value[0].startswith("PYTHON_IMAGE=") for c in commands[:first_from])
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", args["PYTHON_IMAGE"]), args["PYTHON_IMAGE"]
    assert re.fullmatch(r"[0-9]+(\.[0-9]+)+", args["PIP_VERSION"]), args["PIP_VERSION"]
    installs = [part.strip() for c in commands if c.cmd == "RUN" for part in c.value[0].split("&&")
                if "pip install" in part]
    assert installs, "no pip install in the Dockerfile"
    for part in installs:
        if '"pip==${PIP_VERSION}"' in part:
            continue
        assert "--upgrade pip" not in part and "-U pip" not in part
        assert "-c constraints.txt" in part, f"an install not under the constraints: {part}"
    assert any('"pip==${PIP_VERSION}"' in part for part in installs)
    # The package is built with the pinned setuptools, not an unpinned one fetched for an isolated build.
    assert any("--no-build-isolation" in part and "${EXTRAS" in part for part in installs)
    assert any(part.endswith("-c constraints.txt setuptools") for part in installs)


def test_every_extra_is_pinned_exactly() -> None:
    from packaging.requirements import Requirement

    extras = _pyproject()["project"]["optional-dependencies"]
    assert {"test", "gpu"} <= set(extras)
    for extra, requirements in extras.items():
        for text in requirements:
            spec = list(Requirement(text).specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"[{extra}] {text}: not pinned as tested"


def _closure(names: list[str]) -> set[str]:
    """Every distribution ``names`` pull in here (markers evaluated for this interpreter, no extras)."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue  # pinned by name below; not installed here to follow further
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_constraints_pin_everything_the_image_installs() -> None:
    """The store's dependencies and the gpu extra's, with all they pull in, each pinned exactly, at a
    version pyproject accepts: what the image installs is what was tested."""
    from packaging.requirements import Requirement

    pins = _constraints()
    project = _pyproject()["project"]
    base = [Requirement(t) for t in project["dependencies"]]
    gpu = [Requirement(t) for t in project["optional-dependencies"]["gpu"]]
    needed = _closure([r.name for r in base + gpu]) | {"setuptools"}  # the image's build backend too
    missing = sorted(needed - set(pins))
    assert not missing, f"constraints.txt does not pin {missing}"
    for req in base + gpu:
        assert req.specifier.contains(pins[_name(req.name)], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[_name(req.name)]}, outside pyproject's {req}"
    for req in gpu:  # the extra and the image agree exactly
        assert str(req.specifier) == f"=={pins[_name(req.name)]}", req
    test_extra = {_name(Requirement(t).name): Requirement(t) for t in project["optional-dependencies"]["test"]}
    for name, version in pins.items():  # the test environment installs the same versions (.ci/run uses -c)
        if name in test_extra:
            assert test_extra[name].specifier.contains(version), (name, version, str(test_extra[name]))


def test_ci_and_readme_install_under_the_constraints() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"pip install -c constraints\.txt -e '\.\[test\]'", ci), "CI installs without constraints.txt"
    readme = (ROOT / "README.md").read_text()
    assert "pip install -c constraints.txt -e '.[test]'" in readme
