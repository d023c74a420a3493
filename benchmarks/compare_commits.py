"""The same benchmarks on two commits, rounds interleaved: is the newer one as fast?

A refactor must not cost speed (issue 22). This runs each chosen benchmark
script of two source trees, the baseline commit and the head, with the same
arguments, alternately, and reports per figure whether the head is within
noise of the baseline.

The two trees
-------------
``--baseline REV`` becomes a detached ``git worktree`` in a working directory
(a temporary one unless ``--workdir`` is given), with its own virtual
environment: a ``cp -a`` of this checkout's ``.venv`` followed by
``pip install --no-deps --no-build-isolation -e <tree>`` there, so the
baseline imports its own code and builds its own native modules
(``protocol/_chain``, ``protocol/_checksums``; both are optional in setup.py,
so a silent build failure would measure the pure-Python fallbacks). Before
any run, each tree's interpreter is asked where ``prefixstore``,
``prefixstore.store``, ``prefixstore.client``, ``prefixstore.protocol`` and
both native modules come from (``python -P``, from the tree's ``benchmarks/``
directory, as a script there sees it); every file must lie inside that tree,
or the comparison stops. ``--head`` is this checkout as it stands (its
``.venv``) unless a revision is given, which is then prepared like the
baseline. Each benchmark JSON's ``machine.code`` (the commit of the script
that ran) is checked against its tree's commit too.

Each tree runs its own copy of each script (a script follows the library's
internal API, so the baseline's may differ in a line or two). The arguments
are the common subset: a flag is passed only where both trees' ``--help``
list it; a flag dropped, a script missing from one tree, and a script whose
source or ``--help`` differs between the trees are all reported.

Order and noise
---------------
Round k runs every case of both trees back to back: baseline then head in odd
rounds, head then baseline in even ones (B H | H B | B H ...), so a load that
drifts over the run hits both trees alike, and the first-run-after-the-other
position alternates. Each benchmark already interleaves its own baselines rep
by rep; every figure it reports is a median over its reps.

Per figure: the baseline's median over rounds, the head's, and head/baseline.
*Noise* is the larger of the two trees' relative ranges over rounds,
``max((max - min) / median)`` of each tree's per-round values: how far apart
two runs of the *same* code landed on this machine during this comparison.
A figure is within noise when ``|head/baseline - 1| <= noise``; otherwise the
head is faster or slower (by the figure's direction: ms lower is better, GB/s
higher). With one round there is no noise estimate (reported as n/a).
*Control* figures (raw echo, raw socket, raw NIXL READ) run the same code on
both trees; their ratios show what noise alone does to a ratio in this run.

Output (``--out``): ``compare_commits.json`` (settings, trees, notes, every
run's figures, the summary; rewritten after every run, so an interrupted
comparison keeps what it measured), ``compare_commits.md`` (the table),
``compare_commits.png`` (head speed relative to the baseline per figure, with
the noise band), and ``runs/CASE/TREE/rK/`` (each run's own JSON, PNG and log).

    python benchmarks/compare_commits.py                        # 9ba5d4e vs this checkout, ~25 min
    python benchmarks/compare_commits.py --quick --rounds 2     # a smoke run (figures mean nothing)
    python benchmarks/compare_commits.py --report-only          # redo the report from --out/runs
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import _harness as H

REPO = H.HERE.parent
DEFAULT_BASELINE = "9ba5d4e"  # the commit before the house redesign (issue 22)
BENCHES = ("lookup", "cluster_lookup", "transfer", "nixl_transfer", "lookup_latency")
IMPORT_CHECK = ("prefixstore", "prefixstore.protocol", "prefixstore.store", "prefixstore.client",
                "prefixstore.protocol._chain", "prefixstore.protocol._checksums")
FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


# ---------------------------------------------------------------- figures


@dataclass(frozen=True, kw_only=True, slots=True)
class Figure:
    """One number a benchmark run reports."""

    name: str
    unit: str  # "ms" (lower is better) or "GB/s" (higher is better)
    value: float
    control: bool = False  # same code on both trees (a raw baseline): its ratio is noise alone

    @property
    def higher_is_better(self) -> bool:
        return self.unit == "GB/s"


Extractor = Callable[[dict[str, object]], list[Figure]]


def _results(payload: dict[str, object]) -> list[dict[str, object]]:
    results = payload["results"]
    assert isinstance(results, list), "a benchmark JSON's results is a list"
    return results


def lookup_figures(payload: dict[str, object]) -> list[Figure]:
    """Lookup latency by prompt length and block size: end-to-end, round trip, Store.lookup, hashing."""
    rows = (("end_to_end", "end-to-end"), ("round_trip", "round trip"), ("server_lookup", "Store.lookup"),
            ("hash_array", "hash (array)"), ("echo", "raw echo"))
    out = []
    for r in _results(payload):
        figs = r["figures"]
        assert isinstance(figs, dict)
        for key, label in rows:
            out.append(Figure(name=f"lookup {r['tokens']:,} tok B={r['block_tokens']}: {label}", unit="ms",
                              value=float(figs[key]["median_ms"]), control=key == "echo"))
    return out


def _size(n: object) -> str:
    assert isinstance(n, int)
    return f"{n // 1048576} MiB" if n % 1048576 == 0 else f"{n // 1024} KiB"


def transfer_figures(payload: dict[str, object]) -> list[Figure]:
    """HTTP GET and PUT GB/s by payload size; the raw-socket transfer of the same bytes as the control."""
    rows = (("store_get", "store GET", False), ("store_put", "store PUT", False),
            ("raw_get", "raw GET", True), ("raw_put", "raw PUT", True))
    out = []
    for r in _results(payload):
        figs = r["figures"]
        assert isinstance(figs, dict)
        for key, label, control in rows:
            out.append(Figure(name=f"transfer {_size(r['payload_bytes'])}: {label}", unit="GB/s",
                              value=float(figs[key]["median_gbps"]), control=control))
    return out


def nixl_figures(payload: dict[str, object]) -> list[Figure]:
    """NIXL and HTTP GET/PUT GB/s by payload size, the raw NIXL READ as the control; the prefix load's ms."""
    rows = (("nixl_get", "NIXL GET", False), ("nixl_get_placed", "NIXL GET placed", False),
            ("nixl_put", "NIXL PUT", False), ("http_get", "HTTP GET", False), ("http_put", "HTTP PUT", False),
            ("raw_read", "raw NIXL READ", True))
    out = []
    for r in _results(payload):
        figs = r["figures"]
        assert isinstance(figs, dict)
        for key, label, control in rows:
            out.append(Figure(name=f"nixl {_size(r['payload_bytes'])}: {label}", unit="GB/s",
                              value=float(figs[key]["median_gbps"]), control=control))
    prefix = payload.get("prefix_load")
    if isinstance(prefix, dict):
        for path in ("nixl", "http"):
            out.append(Figure(name=f"nixl prefix load {prefix['tokens']:,} tok: {path}", unit="ms",
                              value=float(prefix[path]["median_ms"])))
    return out


def cluster_lookup_figures(payload: dict[str, object]) -> list[Figure]:
    """The cluster walk against one node, per prompt shape: the cluster's median, the single node's (both
    trees' own code: the single node is the matcher's other caller, not a control)."""
    results = payload["results"]
    assert isinstance(results, dict), "cluster_lookup.json's results map a prompt shape to its figures"
    out = []
    for shape, r in results.items():
        assert isinstance(r, dict)
        out.append(Figure(name=f"cluster lookup, {shape}: cluster", unit="ms", value=float(r["cluster_ms"])))
        out.append(Figure(name=f"cluster lookup, {shape}: single node", unit="ms", value=float(r["single_ms"])))
    return out


def lookup_latency_figures(payload: dict[str, object]) -> list[Figure]:
    """End-to-end lookup p50 per cluster size, load, prompt length and kind (each a new prompt object:
    hashing, the walk and the client's bookkeeping included, as an engine's lookup pays them)."""
    rows = payload["results"]
    assert isinstance(rows, list), "lookup_latency.json's results are rows"
    return [Figure(name=f"lookup latency {r['nodes']} node(s) {r['load']} {r['tokens']:,} tok: {r['kind']}", unit="ms",
                   value=float(r["p50_ms"])) for r in rows]


EXTRACTORS: dict[str, Extractor] = {"lookup.py": lookup_figures, "cluster_lookup.py": cluster_lookup_figures,
                                    "transfer.py": transfer_figures, "nixl_transfer.py": nixl_figures,
                                    "lookup_latency.py": lookup_latency_figures}


# ---------------------------------------------------------------- cases and trees


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One benchmark invocation, run on both trees every round."""

    name: str  # "lookup@131072", "transfer", ...
    script: str  # file in benchmarks/
    args: tuple[tuple[str, str | None], ...]  # (flag, value or None for a switch), before the common-subset filter

    @property
    def extract(self) -> Extractor:
        return EXTRACTORS[self.script]


def build_cases(args: argparse.Namespace) -> list[Case]:
    def opts(*pairs: tuple[str, str | None]) -> tuple[tuple[str, str | None], ...]:
        return tuple(pairs) if not args.quick else (("--quick", None),)  # --quick sets the sizes

    cases: list[Case] = []
    for bench in args.bench:
        if bench == "lookup":
            for tokens in args.lookup_tokens[:1] if args.quick else args.lookup_tokens:
                cases.append(Case(name=f"lookup@{tokens}", script="lookup.py", args=(("--tokens", str(tokens)),) + opts(
                                      ("--reps", str(args.lookup_reps)), ("--warmup", str(args.lookup_warmup)))))
        elif bench == "cluster_lookup":
            cases.append(Case(name="cluster_lookup", script="cluster_lookup.py", args=opts(
                ("--tokens", str(args.cluster_lookup_tokens)), ("--reps", str(args.cluster_lookup_reps)))))
        elif bench == "lookup_latency":
            cases.append(Case(name="lookup_latency", script="lookup_latency.py", args=opts(
                ("--nodes", args.latency_nodes), ("--tokens", args.latency_tokens), ("--reps", str(args.latency_reps)),
                ("--no-loaded", None))))
        elif bench == "transfer":
            cases.append(Case(name="transfer", script="transfer.py", args=opts(
                ("--batch-bytes", args.transfer_batch_bytes), ("--reps", str(args.transfer_reps)))))
        elif bench == "nixl_transfer":
            cases.append(Case(name="nixl_transfer", script="nixl_transfer.py", args=opts(
                ("--batch-bytes", args.nixl_batch_bytes), ("--reps", str(args.nixl_reps)),
                ("--prefix-tokens", str(args.nixl_prefix_tokens)))))
        else:
            raise SystemExit(f"--bench: unknown benchmark {bench!r}; choices: {', '.join(BENCHES)}")
    return cases


@dataclass(kw_only=True, slots=True)
class Tree:
    """A source tree with an interpreter whose ``prefixstore`` is that tree."""

    label: str  # "baseline" or "head"
    rev: str  # as given ("." for this checkout)
    commit: str  # full commit id
    root: Path
    python: Path
    temporary: bool  # a worktree this script made (removed at the end unless kept)
    dirty: bool = False  # library files differ from the commit (this checkout only)
    imports: dict[str, str] = field(default_factory=dict)

    @property
    def short(self) -> str:
        return self.commit[:7]


def git(*argv: str, cwd: Path = REPO) -> str:
    proc = subprocess.run(["git", *argv], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"git {' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout.strip()


def check_imports(python: Path, root: Path) -> dict[str, str]:
    """Where each of IMPORT_CHECK comes from, for ``python`` run as a script in ``root/benchmarks`` sees it."""
    code = ("import importlib, json; print(json.dumps({m: importlib.import_module(m).__file__ for m in "
            f"{list(IMPORT_CHECK)!r}}}))")
    proc = subprocess.run([str(python), "-P", "-c", code], cwd=root / "benchmarks", capture_output=True,
                          text=True, env=clean_env(), timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"{python}: importing prefixstore failed:\n{proc.stderr[-2000:]}")
    files: dict[str, str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return files


def imports_inside(files: dict[str, str], root: Path) -> bool:
    return all(Path(f).resolve().is_relative_to(root.resolve()) for f in files.values())


def clean_env() -> dict[str, str]:
    """This environment without anything that would point an interpreter at another tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # the baseline tree stays as checked out
    return env


def prepare_tree(label: str, rev: str, workdir: Path) -> Tree:
    """This checkout for rev ".", else a detached worktree of rev in workdir with a copied venv (reused if there)."""
    if rev == ".":
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--", "protocol", "transport", "store", "client", "admission", "prefixstore"))
        tree = Tree(label=label, rev=rev, commit=commit, root=REPO, python=REPO / ".venv" / "bin" / "python",
                    temporary=False, dirty=dirty)
    else:
        commit = git("rev-parse", "--verify", f"{rev}^{{commit}}")
        root = workdir / f"{label}-{commit[:7]}"
        if not (root / ".git").exists():
            H.progress(f"{label}: git worktree add --detach {root} {commit[:7]}")
            git("worktree", "add", "--detach", str(root), commit)
        elif git("rev-parse", "HEAD", cwd=root) != commit:
            raise SystemExit(f"{root} holds another commit than {rev}; remove it or pick another --workdir")
        venv = root / ".venv"
        python = venv / "bin" / "python"
        if not venv.exists():
            H.progress(f"{label}: cp -a {REPO / '.venv'} {venv} (a few GB: a minute or more)")
            t = time.monotonic()
            partial = root / ".venv.partial"
            shutil.rmtree(partial, ignore_errors=True)
            subprocess.run(["cp", "-a", str(REPO / ".venv"), str(partial)], check=True)
            partial.rename(venv)
            H.progress(f"{label}: venv copied in {time.monotonic() - t:.0f} s")
        tree = Tree(label=label, rev=rev, commit=commit, root=root, python=python, temporary=True)
        if not imports_inside(check_imports(python, root), root):
            H.progress(f"{label}: pip install --no-deps --no-build-isolation -e {root} (builds the native modules)")
            log = root / ".venv" / "compare_commits_pip.log"
            with log.open("w") as f:
                proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                                       "-e", str(root)], stdout=f, stderr=subprocess.STDOUT, env=clean_env())
            if proc.returncode != 0:
                raise SystemExit(f"{label}: pip install -e failed; see {log}")
    tree.imports = check_imports(tree.python, tree.root)
    if not imports_inside(tree.imports, tree.root):
        raise SystemExit(f"{label}: {tree.python} imports code from outside {tree.root}: "
                         + json.dumps(tree.imports, indent=1))
    H.progress(f"{label}: {tree.short}{' (+ uncommitted library changes)' if tree.dirty else ''} at {tree.root}; "
               f"prefixstore.store from {tree.imports['prefixstore.store']}")
    return tree


def remove_worktree(root: Path) -> None:
    H.progress(f"removing the worktree {root}")
    subprocess.run(["git", "worktree", "remove", "--force", str(root)], cwd=REPO, capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


# ---------------------------------------------------------------- arguments both trees accept


def help_text(tree: Tree, script: str) -> str | None:
    path = tree.root / "benchmarks" / script
    if not path.exists():
        return None
    proc = subprocess.run([str(tree.python), str(path), "--help"], cwd=tree.root, capture_output=True, text=True,
                          env=clean_env(), timeout=120)
    if proc.returncode != 0:
        raise SystemExit(f"{tree.label}: {script} --help exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def common_args(case: Case, helps: Sequence[str]) -> tuple[list[str], list[str]]:
    """The case's argv restricted to flags every --help lists, and the flags dropped."""
    accepted = set.intersection(*(set(FLAG_RE.findall(h)) for h in helps))
    argv: list[str] = []
    dropped: list[str] = []
    for flag, value in case.args:
        if flag not in accepted:
            dropped.append(flag)
            continue
        argv += [flag] if value is None else [flag, value]
    return argv, dropped


def script_notes(case: Case, trees: Sequence[Tree], helps: Sequence[str | None], dropped: Sequence[str]) -> list[str]:
    notes = []
    base, head = trees
    missing = [t.label for t, h in zip(trees, helps) if h is None]
    if missing:
        return [f"{case.script}: missing in {', '.join(missing)}; {case.name} not compared"]
    if dropped:
        notes.append(f"{case.name}: {', '.join(dropped)} not accepted by both trees' {case.script}; not passed")
    src = [(t.root / "benchmarks" / case.script).read_text().splitlines() for t in trees]
    changed = sum(1 for line in difflib.unified_diff(src[0], src[1], lineterm="", n=0)
                  if line[:1] in "+-" and not line.startswith(("+++", "---")))
    if changed:
        notes.append(f"{case.script}: differs between {base.short} and {head.short} ({changed} lines +/-); "
                     "each tree runs its own")
    h0, h1 = (h.split() for h in helps if h is not None)
    if h0 != h1:
        notes.append(f"{case.script}: --help differs between the trees")
    return notes


# ---------------------------------------------------------------- running


@dataclass(kw_only=True, slots=True)
class Run:
    case: str
    tree: str
    round: int
    out: str
    seconds: float
    ok: bool
    loadavg_1m: float
    code: str = ""  # the benchmark JSON's machine.code
    figures: dict[str, float] = field(default_factory=dict)
    error: str = ""


def run_one(case: Case, tree: Tree, argv: list[str], k: int, out: Path, timeout_s: float) -> tuple[Run, list[Figure]]:
    run_dir = out / "runs" / case.name / tree.label / f"r{k}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [str(tree.python), str(tree.root / "benchmarks" / case.script), *argv, "--out", str(run_dir)]
    load = os.getloadavg()[0]
    t = time.monotonic()
    with (run_dir / "log.txt").open("w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # its own session, so that an interrupted comparison takes the script's store children down with it
        proc = subprocess.Popen(cmd, cwd=tree.root, stdout=log, stderr=subprocess.STDOUT, env=clean_env(),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            rc = -1
        except BaseException:
            stop_group(proc)
            raise
    run = Run(case=case.name, tree=tree.label, round=k, out=str(run_dir), seconds=time.monotonic() - t,
              ok=False, loadavg_1m=round(load, 2))
    json_path = run_dir / f"{case.script.removesuffix('.py')}.json"
    if rc != 0 or not json_path.exists():
        tail = (run_dir / "log.txt").read_text()[-1500:]
        run.error = f"exit {rc}" if rc != -1 else f"timed out after {timeout_s:.0f} s"
        H.progress(f"  {case.name} on {tree.label} FAILED ({run.error}); log tail:\n{tail}")
        return run, []
    return finish_run(run, case, tree, json_path)


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the run's process group (the script and the servers it started), SIGKILL what is left."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the script is gone; its children may not be
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return


def same_code(tree: Tree, code: str, script: str) -> bool:
    """The run's commit is the tree's, or differs from it only outside the library and the script's files."""
    commit = code.removesuffix("+dirty")
    if commit.startswith(tree.short) or not commit:
        return bool(commit)
    proc = subprocess.run(["git", "diff", "--quiet", tree.commit, commit, "--", "protocol", "store", "client",
                           "admission", "prefixstore", "gpu_staging", "setup.py", "pyproject.toml",
                           f"benchmarks/{script}", "benchmarks/_harness.py", "benchmarks/_serve.py"],
                          cwd=REPO, capture_output=True)
    return proc.returncode == 0


def finish_run(run: Run, case: Case, tree: Tree, json_path: Path) -> tuple[Run, list[Figure]]:
    payload = json.loads(json_path.read_text())
    run.code = str(payload.get("machine", {}).get("code", ""))
    if not same_code(tree, run.code, case.script):
        run.error = f"the JSON says code {run.code}, the {tree.label} tree is {tree.short}"
        H.progress(f"  {case.name} on {tree.label}: {run.error}; not counted")
        return run, []
    figures = case.extract(payload)
    run.figures = {f.name: f.value for f in figures}
    run.ok = True
    return run, figures


# ---------------------------------------------------------------- summary


def relative_range(values: Sequence[float]) -> float:
    """(max - min) / median: the spread between rounds of one tree."""
    return (max(values) - min(values)) / statistics.median(values)


def summarize(base: Sequence[float], head: Sequence[float], higher_is_better: bool) -> dict[str, object]:
    """Medians over rounds, head/baseline, the noise band and the verdict (module docstring: "Order and noise")."""
    mb, mh = statistics.median(base), statistics.median(head)
    ratio = mh / mb
    speed = ratio if higher_is_better else 1.0 / ratio  # > 1: the head is faster
    noise = max(relative_range(base), relative_range(head)) if min(len(base), len(head)) >= 2 else None
    if noise is None:
        verdict = "n/a (one round)"
    elif abs(ratio - 1.0) <= noise:
        verdict = "within noise"
    else:
        verdict = "head faster" if speed > 1.0 else "head SLOWER"
    return {"baseline_median": mb, "head_median": mh, "ratio": ratio, "speed": speed, "noise": noise,
            "verdict": verdict, "baseline_rounds": list(base), "head_rounds": list(head)}


def summary_rows(units: dict[str, Figure], runs: Sequence[Run]) -> list[dict[str, object]]:
    rows = []
    for name, fig in units.items():
        per = {label: [r.figures[name] for r in runs if r.ok and r.tree == label and name in r.figures]
               for label in ("baseline", "head")}
        if not per["baseline"] or not per["head"]:
            continue
        row: dict[str, object] = {"figure": name, "unit": fig.unit, "control": fig.control}
        row.update(summarize(per["baseline"], per["head"], fig.higher_is_better))
        rows.append(row)
    return rows


def table(rows: Sequence[dict[str, object]]) -> str:
    cells = []
    for r in rows:
        noise = r["noise"]
        cells.append([str(r["figure"]) + (" (control)" if r["control"] else ""), r["unit"], r["baseline_median"],
                      r["head_median"], f"{r['ratio']:.3f}", f"{r['speed']:.2f}x",
                      "n/a" if noise is None else f"{100 * float(noise):.0f}%", r["verdict"]])  # type: ignore[arg-type]
    return H.print_table("Head vs baseline (median over rounds; speed > 1: head faster; noise: the larger "
                         "relative range over rounds of either tree)",
                         ["figure", "unit", "baseline", "head", "head/base", "speed", "noise ±", "verdict"], cells)


XLIM = (0.25, 4.0)  # speed axis of the plot; bands and points beyond it are drawn at its edge


def noise_band(noise: float, higher_is_better: bool) -> tuple[float, float]:
    """The band |head/baseline - 1| <= noise in speed terms (a ms figure's speed is baseline/head)."""
    if higher_is_better:
        return max(1.0 - noise, XLIM[0]), min(1.0 + noise, XLIM[1])
    return max(1.0 / (1.0 + noise), XLIM[0]), XLIM[1] if noise >= 1.0 - 1.0 / XLIM[1] else 1.0 / (1.0 - noise)


def plot(rows: Sequence[dict[str, object]], title: str, path: Path) -> None:
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(11, 0.28 * len(rows) + 1.4))
    ys = list(range(len(rows)))[::-1]
    for y, r in zip(ys, rows):
        noise = r["noise"]
        if noise is not None:
            lo, hi = noise_band(float(noise), r["unit"] == "GB/s")  # type: ignore[arg-type]
            ax.plot([lo, hi], [y, y], color="0.8", linewidth=6, solid_capstyle="butt", zorder=1)
        verdict = str(r["verdict"])
        color = "0.5" if r["control"] else ("tab:red" if "SLOWER" in verdict else
                                             "tab:green" if "faster" in verdict else "tab:blue")
        speed = min(max(float(r["speed"]), XLIM[0]), XLIM[1])  # type: ignore[arg-type]
        ax.plot([speed], [y], "o", color=color, zorder=2)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(ys)
    ax.set_yticklabels([str(r["figure"]) + (" (control)" if r["control"] else "") for r in rows], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(*XLIM)
    ax.set_xticks([0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0], ["0.25", "0.5", "0.8", "1", "1.25", "2", "4"])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("head speed / baseline speed (> 1: head faster; a ms figure: baseline ms / head ms)\n"
                  "grey bar: noise band; blue: within noise, red: head slower, green: head faster, grey: control",
                  fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.savefig(path, dpi=90, bbox_inches="tight")  # "tight": tight_layout alone clipped the long labels
    plt.close(fig)
    H.progress(f"wrote {path}")


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/compare_commits.py",
        description="Run benchmarks of two commits alternately, with the same arguments, and report per figure "
                    "whether the head is within noise of the baseline (the noise band: the larger relative range "
                    "over rounds of either tree). Writes compare_commits.json, .md and .png to --out.")
    p.add_argument("--baseline", default=DEFAULT_BASELINE,
                   help=f"Revision measured as the baseline, checked out as a git worktree with its own venv. "
                        f"Default: {DEFAULT_BASELINE} (the commit before the house redesign, issue 22).")
    p.add_argument("--head", default=".",
                   help="Revision measured as the head; '.' is this checkout as it stands, with its .venv. "
                        "Default: '.'.")
    p.add_argument("--bench", type=lambda s: [b for b in s.split(",") if b], default=list(BENCHES),
                   metavar="B,B", help=f"Comma-separated benchmarks among {', '.join(BENCHES)}. Default: all of them.")
    p.add_argument("--rounds", type=int, default=3,
                   help="Rounds; each runs every case on both trees (B H, then H B, ...). The noise band needs "
                        "at least 2. Default: 3.")
    p.add_argument("--lookup-tokens", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 131072],
                   metavar="N,N", help="Prompt lengths for lookup.py, one run per length per tree per round. "
                                       "Default: 16384,131072.")
    p.add_argument("--lookup-reps", type=int, default=150, help="lookup.py --reps. Default: 150.")
    p.add_argument("--lookup-warmup", type=int, default=10, help="lookup.py --warmup. Default: 10.")
    p.add_argument("--cluster-lookup-tokens", type=int, default=32768,
                   help="cluster_lookup.py --tokens (4 node processes and one, in each tree). Default: 32768.")
    p.add_argument("--cluster-lookup-reps", type=int, default=60, help="cluster_lookup.py --reps. Default: 60.")
    p.add_argument("--latency-nodes", default="4",
                   help="lookup_latency.py --nodes (idle only, --no-loaded). Default: 4.")
    p.add_argument("--latency-tokens", default="32768,131072", help="lookup_latency.py --tokens. Default: 32768,131072.")
    p.add_argument("--latency-reps", type=int, default=200, help="lookup_latency.py --reps. Default: 200.")
    p.add_argument("--transfer-batch-bytes", default="16MiB", help="transfer.py --batch-bytes. Default: 16MiB.")
    p.add_argument("--transfer-reps", type=int, default=7, help="transfer.py --reps. Default: 7.")
    p.add_argument("--nixl-batch-bytes", default="16MiB", help="nixl_transfer.py --batch-bytes. Default: 16MiB.")
    p.add_argument("--nixl-reps", type=int, default=7, help="nixl_transfer.py --reps. Default: 7.")
    p.add_argument("--nixl-prefix-tokens", type=int, default=32768,
                   help="nixl_transfer.py --prefix-tokens (the timed full load of a prefix). Default: 32768.")
    p.add_argument("--quick", action="store_true",
                   help="Pass --quick to every script instead of the size flags (one lookup length): a smoke "
                        "run of this script; figures mean nothing.")
    p.add_argument("--run-timeout-s", type=float, default=900.0,
                   help="A benchmark run taking longer is killed and counted as failed. Default: 900.")
    p.add_argument("--workdir", type=Path, default=None,
                   help="Where the worktrees and their venvs go; given, they are kept and reused by the next "
                        "run. Default: a temporary directory, removed at the end.")
    p.add_argument("--keep", action="store_true", help="Keep the temporary worktrees (the path is printed).")
    p.add_argument("--out", type=Path, default=H.DEFAULT_OUT / "compare_commits",
                   help="Directory for the results (created if missing). Default: benchmarks/out/compare_commits.")
    p.add_argument("--report-only", action="store_true",
                   help="Run nothing: rebuild the report from the runs already under --out (its "
                        "compare_commits.json names the trees).")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    return args


def report(args: argparse.Namespace, trees: Sequence[Tree], cases: Sequence[Case], notes: list[str],
           runs: Sequence[Run], units: dict[str, Figure], done: bool) -> None:
    rows = summary_rows(units, runs)
    notes = list(dict.fromkeys(notes))  # two lookup lengths, one script: one note
    payload: dict[str, object] = {
        "benchmark": "compare_commits", "argv": getattr(args, "command", sys.argv[1:]), "complete": done,
        "machine": H.machine_note(),
        "trees": [{k: str(v) if isinstance(v, Path) else v for k, v in asdict(t).items()} for t in trees],
        "cases": [{"name": c.name, "script": c.script, "args": c.args} for c in cases],
        "notes": notes, "runs": [asdict(r) for r in runs], "figures": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    if done:
        base, head = trees
        text = table(rows)
        measured = [r for r in rows if not r["control"]]
        slower = [str(r["figure"]) for r in measured if "SLOWER" in str(r["verdict"])]
        speeds = [float(r["speed"]) for r in measured]  # type: ignore[arg-type]
        geo = statistics.geometric_mean(speeds) if speeds else float("nan")
        lines = [f"head {head.short}{'+dirty' if head.dirty else ''} vs baseline {base.short}, {args.rounds} rounds: "
                 f"{len(measured) - len(slower)}/{len(measured)} figures within noise or faster; geometric mean "
                 f"speed {geo:.3f}x" + (f"; outside noise, slower: {', '.join(slower)}" if slower else "")]
        print(lines[0])
        for n in notes:
            print(f"note: {n}")
        payload["summary"] = {"geomean_speed": geo, "slower": slower, "text": lines[0]}
        payload["table_markdown"] = text
        (args.out / "compare_commits.md").write_text(text + "\n\n" + "\n".join(lines + [f"note: {n}" for n in notes])
                                                     + "\n")
        plot(rows, f"{head.short} vs {base.short}: {args.rounds} rounds, geometric mean speed {geo:.3f}x",
             args.out / "compare_commits.png")
    (args.out / "compare_commits.json").write_text(json.dumps(payload, indent=2) + "\n")
    if done:
        H.progress(f"wrote {args.out / 'compare_commits.json'}")


def report_only(args: argparse.Namespace) -> int:
    prev = json.loads((args.out / "compare_commits.json").read_text())
    trees = [Tree(label=t["label"], rev=t["rev"], commit=t["commit"], root=Path(t["root"]),
                  python=Path(t["python"]), temporary=t["temporary"], dirty=t["dirty"],
                  imports=t["imports"]) for t in prev["trees"]]
    cases = [Case(name=c["name"], script=c["script"], args=tuple((f, v) for f, v in c["args"]))
             for c in prev["cases"]]
    by_name = {c.name: c for c in cases}
    args.rounds = max((int(r["round"]) for r in prev["runs"]), default=0)
    args.command = prev["argv"]
    runs: list[Run] = []
    units: dict[str, Figure] = {}
    for r in prev["runs"]:
        case, tree = by_name.get(r["case"]), next(t for t in trees if t.label == r["tree"])
        path = Path(r["out"]) / f"{case.script.removesuffix('.py')}.json" if case else None
        if case is None or path is None or not path.exists():
            continue
        run = Run(**{**r, "figures": {}, "ok": False, "error": ""})
        run, figs = finish_run(run, case, tree, path)
        runs.append(run)
        units.update({f.name: f for f in figs if f.name not in units})
    report(args, trees, cases, list(prev["notes"]), runs, units, done=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill runs the clean-up below, as Ctrl-C does
    if args.report_only:
        return report_only(args)
    cases = build_cases(args)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="compare_commits-"))
    workdir.mkdir(parents=True, exist_ok=True)
    trees: list[Tree] = []
    try:
        trees = [prepare_tree("baseline", args.baseline, workdir), prepare_tree("head", args.head, workdir)]
        notes: list[str] = []
        argvs: dict[str, list[str]] = {}
        for case in cases:
            helps = [help_text(t, case.script) for t in trees]
            present = [h for h in helps if h is not None]
            argv, dropped = common_args(case, present) if len(present) == 2 else ([], [])
            notes += script_notes(case, trees, helps, dropped)
            if len(present) == 2:
                argvs[case.name] = argv
        cases = [c for c in cases if c.name in argvs]
        for n in dict.fromkeys(notes):
            H.progress(f"note: {n}")
        runs: list[Run] = []
        units: dict[str, Figure] = {}
        total = args.rounds * len(cases) * 2
        t0 = time.monotonic()
        for k in range(1, args.rounds + 1):
            order = trees if k % 2 == 1 else trees[::-1]
            for case in cases:
                for tree in order:
                    i = len(runs) + 1
                    H.progress(f"[{i}/{total}] round {k}/{args.rounds}: {case.name} on {tree.label} ({tree.short}) "
                               f"{' '.join(argvs[case.name])}")
                    run, figs = run_one(case, tree, argvs[case.name], k, args.out, args.run_timeout_s)
                    runs.append(run)
                    units.update({f.name: f for f in figs if f.name not in units})
                    elapsed = time.monotonic() - t0
                    H.progress(f"[{i}/{total}] {'ok' if run.ok else 'FAILED'} in {run.seconds:.0f} s (load "
                               f"{run.loadavg_1m} at start); ~{elapsed / i * (total - i) / 60:.0f} min left")
                    report(args, trees, cases, notes, runs, units, done=False)
        report(args, trees, cases, notes, runs, units, done=True)
        return 0 if all(r.ok for r in runs) else 1
    finally:
        made = sorted(d for d in workdir.iterdir() if (d / ".git").exists())  # also those of a failed start
        if args.workdir is None and not args.keep:
            for d in made:
                remove_worktree(d)
            shutil.rmtree(workdir, ignore_errors=True)
        elif made:
            H.progress(f"kept {', '.join(map(str, made))}")


if __name__ == "__main__":
    raise SystemExit(main())
