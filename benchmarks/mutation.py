"""Mutation testing of the policy and metric paths with cosmic-ray (not in CI: it takes hours).

For each target module, cosmic-ray makes every mutant its operators know (a `<`
turned into `<=`, a `+ 1` into `- 1`, a `True` into `False`, ...), runs the
target's tests against each, and counts the mutant *killed* if a test fails.
The kill rate is the share of mutants killed; every survivor is printed with
its line and diff, and docs/testing.md gives each one a reason.

It runs in a scratch copy of the working tree, never in it: cosmic-ray edits the
module file in place. In the copy, `prefixstore/admission` and the other parts are
symlinks to the copy's own directories (the mapping pyproject's package-dir
makes), and the copy comes first on sys.path (the editable install's finder
comes after the path finder), so the mutants are what the tests import.

    pip install '.[mutation]'
    python benchmarks/mutation.py                           # every target (hours on 2 cores)
    python benchmarks/mutation.py --targets admission       # the targets whose name starts so
    python benchmarks/mutation.py --targets store/index.py --limit 40   # a sample, for a quick look

Mutants inside type annotations are skipped as equivalent (the modules use ``from
__future__ import annotations``: annotations are never evaluated). The scope is the
TARGETS list below: a module, optionally only some of its
functions (``functions``: the names cosmic-ray reports as the mutant's enclosing
definition), and the tests that guard it. Edit the list when the code moves.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COSMIC_RAY = str(Path(sys.executable).parent / "cosmic-ray")  # the console script beside this interpreter
PACKAGES = {"protocol": "protocol", "transport": "transport", "store": "store", "client": "client", "admission": "admission",
            "gpu_staging": "gpu_staging"}  # prefixstore.<name> -> directory (pyproject's package-dir)

POLICY_TESTS = ("tests/admission", "tests/store/test_policy_settings.py", "tests/store/test_metric_values.py")
STORE_TESTS = ("tests/store/test_metric_values.py", "tests/store/test_policy_settings.py", "tests/store/test_core.py",
               "tests/store/test_lookup_signals.py", "tests/store/test_write_decisions.py",
               "tests/store/test_index_model.py", "tests/store/test_index_check.py")

REPLICATION_TESTS = ("tests/store/test_replication_rules.py",)


@dataclass(frozen=True)
class Target:
    path: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] | None = None  # None: the whole module


TARGETS: list[Target] = [
    Target("admission/admission.py", POLICY_TESTS),
    Target("admission/eviction.py", POLICY_TESTS),
    Target("admission/retention.py", POLICY_TESTS),
    Target("admission/sighting.py", POLICY_TESTS),
    Target("admission/policy.py", POLICY_TESTS),
    Target("admission/model_shape.py", POLICY_TESTS),
    Target("store/index.py", STORE_TESTS),
    Target("store/metrics.py", STORE_TESTS),
    # The Store is a thin facade over services (docs/design.md): the lookup -> sighting path and
    # the lookup counters live in store/lookups.py, admission decisions and their counters in
    # store/writes.py, eviction (policy hooks, eviction counters) in store/space.py.
    Target("store/lookups.py", STORE_TESTS, ("lookup", "_junction", "report", "learn")),
    Target("store/writes.py", STORE_TESTS, ("_triage", "offer", "plan_put", "_count")),
    Target("store/space.py", STORE_TESTS),
    # Hot-prefix replication's arithmetic (rates, copies, hysteresis, the push budget); the pushes
    # and drops themselves are node-to-node I/O, tested by tests/cluster/test_replication.py.
    Target("store/replication.py", REPLICATION_TESTS,
           ("copies_for", "on_reads", "rate", "plan", "_fill", "delay", "take")),
    Target("store/core.py", STORE_TESTS, ("shape_of", "stats", "_gauges")),
]


def make_copy(dest: Path) -> None:
    """The tracked files of the working tree (as they are now), the built native modules,
    and symlinks that map each part under `prefixstore` as pyproject's package-dir does."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for so in ROOT.glob("protocol/*.so"):
        shutil.copy2(so, dest / "protocol" / so.name)
    for name, directory in PACKAGES.items():  # prefixstore/admission -> ../admission, ...
        (dest / "prefixstore" / name).symlink_to(Path("..") / directory)


def config_text(target: Target, timeout_s: float) -> str:
    cmd = f"{sys.executable} -m pytest -x -q -p no:cacheprovider {' '.join(target.tests)}"
    return (f'[cosmic-ray]\nmodule-path = "{target.path}"\ntimeout = {timeout_s}\nexcluded-modules = []\n'
            f'test-command = "{cmd}"\n\n[cosmic-ray.distributor]\nname = "local"\n')


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) of every annotation. Mutants inside one are equivalent: the modules use
    ``from __future__ import annotations``, so annotations are never evaluated."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        notes: list[ast.expr | None] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            notes.append(node.returns)
            a = node.args
            notes += [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if x]
        elif isinstance(node, ast.AnnAssign):
            notes.append(node.annotation)
        spans += [((n.lineno, n.col_offset), (n.end_lineno or n.lineno, n.end_col_offset or 0)) for n in notes if n]
    return spans


def run_target(target: Target, work: Path, timeout_s: float, limit: int | None, seed: int) -> dict[str, object]:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    name = target.path.replace("/", "_")
    cfg = work / f"{name}.toml"
    db_path = work / f"{name}.sqlite"
    cfg.write_text(config_text(target, timeout_s))
    env = dict(os.environ, PYTHONPATH=str(work))
    subprocess.run([COSMIC_RAY, "init", str(cfg), str(db_path)], cwd=work, env=env, check=True)
    skipped = WorkResult(worker_outcome=WorkerOutcome.SKIPPED)
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        items = list(db.pending_work_items)
        out_of_scope = [i.job_id for i in items if target.functions is not None
                        and not any(m.definition_name in target.functions for m in i.mutations)]
        db.set_multiple_results(out_of_scope, skipped)
        source = (work / target.path).read_text()
        spans = annotation_spans(source) if "from __future__ import annotations" in source else []
        equivalent = [i.job_id for i in items if i.job_id not in set(out_of_scope)
                      and any(a <= tuple(m.start_pos) < b for m in i.mutations for a, b in spans)]
        db.set_multiple_results(equivalent, skipped)
        in_scope = [i for i in items if i.job_id not in set(out_of_scope) | set(equivalent)]
        # cosmic-ray hands out pending items in random order (ORDER BY random()) under random job
        # ids, so the sample is drawn from the mutants in source order: the same seed, limit and
        # source give the same sample.
        in_scope.sort(key=lambda i: [(tuple(m.start_pos), tuple(m.end_pos), m.operator_name, m.occurrence) for m in i.mutations])
        if limit is not None and len(in_scope) > limit:
            keep = {i.job_id for i in random.Random(seed).sample(in_scope, limit)}
            db.set_multiple_results([i.job_id for i in in_scope if i.job_id not in keep], skipped)
    started = time.perf_counter()
    subprocess.run([COSMIC_RAY, "exec", str(cfg), str(db_path)], cwd=work, env=env, check=True)
    killed = survived = incompetent = 0
    survivors: list[dict[str, object]] = []
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.worker_outcome == WorkerOutcome.SKIPPED:
                continue
            if result.test_outcome is None or result.test_outcome.value == "incompetent":
                incompetent += 1  # the mutant did not even import, or the worker failed
            elif result.test_outcome.value == "survived":
                survived += 1
                m = item.mutations[0]
                survivors.append({"line": m.start_pos[0], "operator": m.operator_name,
                                  "definition": m.definition_name, "diff": result.diff})
            else:
                killed += 1
    judged = killed + survived
    return {"module": target.path, "functions": target.functions, "tests": target.tests,
            "in_scope": len(in_scope), "annotation_mutants_skipped": len(equivalent), "killed": killed,
            "survived": survived, "incompetent": incompetent,
            "kill_rate": killed / judged if judged else None, "seconds": time.perf_counter() - started,
            "survivors": sorted(survivors, key=lambda s: int(s["line"]))}  # type: ignore[call-overload]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default="", help="Comma-separated prefixes of target paths (default: all).")
    parser.add_argument("--limit", type=int, default=None,
                        help="At most this many mutants per target, sampled (seeded): a quick look, not a kill rate.")
    parser.add_argument("--seed", type=int, default=0,
                        help="Seed of --limit's sample (drawn from the mutants in source order: reproducible).")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="Seconds one mutant's tests may take (a mutant that loops is counted killed).")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out",
                        help="Directory for mutation.json.")
    parser.add_argument("--keep", action="store_true", help="Keep the scratch copy (its path is printed).")
    a = parser.parse_args(argv)
    prefixes = [p for p in a.targets.split(",") if p]
    targets = [t for t in TARGETS if not prefixes or any(t.path.startswith(p) for p in prefixes)]
    if not targets:
        parser.error(f"--targets: nothing matches {a.targets!r}; targets are {[t.path for t in TARGETS]}")
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        parser.error("cosmic-ray is not installed: pip install '.[mutation]'")
    work = Path(tempfile.mkdtemp(prefix="prefixstore-mutation-"))
    results = []
    try:
        make_copy(work)
        for t in targets:
            print(f"== {t.path}" + (f" ({', '.join(t.functions)})" if t.functions else ""), flush=True)
            r = run_target(t, work, a.timeout, a.limit, a.seed)
            results.append(r)
            rate = "n/a" if r["kill_rate"] is None else f"{r['kill_rate']:.1%}"
            print(f"   killed {r['killed']}, survived {r['survived']}, incompetent {r['incompetent']}: "
                  f"kill rate {rate} in {r['seconds']:.0f}s", flush=True)
            for s in r["survivors"]:  # type: ignore[attr-defined]
                diff = "\n".join(line for line in (s["diff"] or "").splitlines() if line[:1] in "+-"
                                 and not line.startswith(("+++", "---")))
                print(f"   survived: line {s['line']} ({s['definition']}, {s['operator']})\n      "
                      + diff.replace("\n", "\n      "))
    finally:
        if a.keep:
            print(f"scratch copy kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    killed = sum(int(r["killed"]) for r in results)  # type: ignore[call-overload]
    judged = killed + sum(int(r["survived"]) for r in results)  # type: ignore[call-overload]
    print(f"total: {killed}/{judged} killed ({killed / judged:.1%})" if judged else "total: nothing judged")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "mutation.json").write_text(json.dumps({"limit": a.limit, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
