"""Does each feature's test fail when the feature is switched off? (`bash scripts/mutations.sh`, which runs this.)

tests/mutations/NAME.patch switches one feature off; its first line says what, its `# unit:` and `# engine:` lines
name the tests that claim the feature at each level (`# engine: none: WHY` where no real-engine test can claim it: a
pure planner figure). For each level asked:

1. the test tools must be there (pytest in the Python that runs the tests), else nothing runs;
2. the named tests of every patch run once on a scratch copy of the clean tree: all must pass (a test that already
   fails, errors or skips there could not tell a mutation from the clean tree);
3. each patch is applied to its own scratch copy and its tests run there. It is **killed** only when a named test
   fails on an assertion (JUnit `failure` whose message is an `AssertionError`, a bare `assert`, or pytest's
   `Failed:` such as "DID NOT RAISE"), not by an error (a fixture, an import, an exception the test did not expect),
   not by a collection failure, and not by a timeout unless the patch says `# kills: hang`.

Anything else fails the run: a patch that no longer applies, one that names no tests for a level asked, one whose
tests pass with it (SURVIVED), one whose tests only error. `--record FILE` writes the verdicts with the date and the
commit (JSON), as tests/mutations/engine-verdicts.json keeps the last engine-level run.

    bash scripts/mutations.sh [--unit | --engine | --all] [--record FILE] [--dir DIR] [NAME ...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LEVELS = ("unit", "engine")
_ASSERTION = re.compile(r"^(AssertionError\b|assert |Failed: )")


@dataclass
class Patch:
    name: str
    path: Path
    what: str
    tests: dict[str, list[str]] = field(default_factory=dict)  # level -> test ids (empty: none at that level)
    why_none: dict[str, str] = field(default_factory=dict)  # level -> why no test claims it there
    hang: bool = False  # a timeout is the claim's own failure (`# kills: hang`)

    @classmethod
    def read(cls, path: Path) -> Patch:
        lines = path.read_text().splitlines()
        patch = cls(path.stem, path, lines[0].lstrip("# ").strip() if lines else "")
        for line in lines:
            for level in LEVELS:
                if line.startswith(f"# {level}:"):
                    value = line.split(":", 1)[1].strip()
                    if value.startswith("none"):
                        patch.why_none[level] = value
                    else:
                        patch.tests[level] = value.split()
            if line.strip() == "# kills: hang":
                patch.hang = True
        return patch


@dataclass
class Outcome:
    """Per test id run: "passed", "skipped", ("failure", message) or ("error", message)."""

    exit_code: int
    cases: dict[str, tuple[str, str]]
    log: str


def python_for_tests() -> str:
    given = os.environ.get("SUMMIT_MUTATION_PYTHON")
    if given:
        return given
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def copy_tree(to: Path) -> None:
    """The working tree as it is (tracked and new files, not what git ignores)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = raw.decode()
        src = REPO / rel
        if src.is_file():
            (to / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, to / rel)


def run_tests(tree: Path, tests: list[str], py: str, name: str, first_failure: bool = False) -> Outcome:
    """The tests on `tree`; with `first_failure`, up to the first that fails (a mutated tree: its verdict is that
    failure's, so a test that errors first is not a kill even where a later one would have failed on an assertion).
    Unit tests run in a child forked from one warm Python (`_forks`); engine tests in a Python of their own."""
    junit = tree.parent / f"{tree.name}.xml"
    env = {"PYTHONPATH": str(tree), "SUMMIT_MUTATION": name}
    unit = all(t.startswith("tests/unit/") for t in tests)
    args = ["-q", "-p", "no:cacheprovider", *(["-x"] if first_failure else [])]
    # a hang is no kill (unless the patch says so): each test has a bound (pytest-timeout, as the suite's)
    args += ["--timeout", "300" if unit else "900", f"--junitxml={junit}", *tests]
    if unit:
        code, log = _forks(py).run(tree, args, env)
    else:
        run = subprocess.run(
            [py, "-m", "pytest", *args], cwd=tree, env={**os.environ, **env}, capture_output=True, text=True
        )
        code, log = run.returncode, run.stdout + run.stderr
    return Outcome(code, read_junit(junit), log)


# The unit tests' plugins, loaded by name (no other installed plugin's import on each run): pytest-timeout for the
# bound, xdist for the hook tests/conftest.py declares.
UNIT_PLUGINS = ["-p", "xdist.plugin", "-p", "pytest_timeout"]
# Imported once by the warm Python before it forks: what each unit-test run would import again (Ray's is 2 s of it).
# Nothing of Summit's: each child imports those from its own tree. HEAVY too where several patches run: the
# tokenizer (7 s) that the routing, stream and sbatch tests load. Not vLLM: its import runs Summit's vLLM plugins
# (pyproject's entry points), which would import Summit's modules from the repository instead of each tree.
WARM = ("pytest", "xdist.plugin", "pytest_timeout", "ray.serve", "fastapi", "httpx", "pydantic", "yaml", "psutil")
HEAVY = ("transformers:AutoTokenizer",)
SUMMIT = ("app", "deployments", "tests", "scripts", "bench")


class Forks:
    """A Python (the one with the test tools) that imported pytest and the heavy libraries once and forks a child
    for each unit-test run: the child enters its tree (sys.path, cwd, environment) and runs pytest there; a run
    costs its tests, not 4 s of imports and plugin loading."""

    def __init__(self, py: str, warm: list[str]):
        self.proc = subprocess.Popen(
            [py, str(Path(__file__).resolve()), "--forks", *warm],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        )

    def run(self, tree: Path, args: list[str], env: dict[str, str]) -> tuple[int, str]:
        log = tree.parent / f"{tree.name}.log"
        job = {"tree": str(tree), "args": UNIT_PLUGINS + args, "env": env, "log": str(log)}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the warm Python ended (exit {self.proc.wait()})")
        return int(answer), log.read_text(errors="replace") if log.exists() else ""


_warm: dict[str, Forks] = {}
HEAVY_FROM = 3  # patches in a run from which HEAVY is worth its 12 s once


def _forks(py: str, patches: int = 1) -> Forks:
    if py not in _warm:
        _warm[py] = Forks(py, list(WARM) + (list(HEAVY) if patches >= HEAVY_FROM else []))
    return _warm[py]


def serve_forks(warm: list[str]) -> int:
    """`mutations.py --forks MODULE[:ATTR]...` (run by the test Python): import those, then for each job line on stdin
    fork a child that runs pytest in the job's tree with its output in the job's log; answer each with the exit
    code."""
    import importlib

    for name in warm:
        module, _, attr = name.partition(":")
        try:
            loaded = importlib.import_module(module)
            if attr:
                getattr(loaded, attr)  # a lazy module's attribute loads what it names
        except Exception:  # noqa: BLE001 — a module not installed here is imported by the child if it needs it
            pass
    ours = sorted(m for m in sys.modules if m.split(".")[0] in SUMMIT)
    if ours:  # a child would test these (the repository's) instead of its tree's
        print(f"mutations: warming imported Summit's own modules: {ours[:5]}", file=sys.stderr)
        return 3
    for line in sys.stdin:
        job = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.chdir(job["tree"])
                sys.path.insert(0, job["tree"])
                os.environ.update(job["env"])
                import pytest

                code = int(pytest.main(job["args"]))
            except BaseException as e:  # noqa: BLE001 — the child says why and ends, whatever happened
                print(f"mutations: the test run could not start: {e!r}", file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    return 0


def read_junit(path: Path) -> dict[str, tuple[str, str]]:
    if not path.exists():
        return {}
    cases = {}
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # pytest's classname: tests.unit.test_x (a module) or tests.unit.test_x.TestClass
        cut = next((i for i in range(len(parts), 0, -1) if (REPO / Path(*parts[:i])).with_suffix(".py").exists()), 0)
        node = "/".join(parts[:cut]) + ".py" + "".join(f"::{p}" for p in parts[cut:]) + f"::{case.get('name')}"
        found = ("passed", "")
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                found = (tag, element.get("message") or ((element.text or "").strip().splitlines() or [""])[-1])
                break
        if found[0] == "failure" or cases.get(node, ("passed",))[0] == "passed":
            cases[node] = found
    return cases


def claimed(cases: dict[str, tuple[str, str]], tests: list[str]) -> dict[str, tuple[str, str]]:
    """The cases that the patch's named tests (files, or file::test ids) select."""
    return {
        node: v
        for node, v in cases.items()
        if any(node == t or node.startswith((f"{t}::", f"{t}[")) for t in tests)  # a file, a test, its parameters
    }


def is_assertion(message: str, hang: bool) -> bool:
    if "Timeout" in message:
        return hang
    return bool(_ASSERTION.match(message.strip()))


def verdict(patch: Patch, level: str, outcome: Outcome) -> tuple[bool, str]:
    cases = claimed(outcome.cases, patch.tests[level])
    if not cases:
        return False, f"the tests did not run (pytest exit {outcome.exit_code}):\n" + tail(outcome.log)
    for node, (state, message) in cases.items():
        if state == "failure" and is_assertion(message, patch.hang):
            return True, f"killed by {node} ({short(message)})"
    errors = [(n, s, m) for n, (s, m) in cases.items() if s in ("failure", "error")]
    if errors:
        node, state, message = errors[0]
        return False, f"NOT KILLED BY AN ASSERTION: {node} ended in {state}: {short(message)}"
    return False, f"SURVIVED: {' '.join(patch.tests[level])} pass with it"


def short(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= 160 else line[:159] + "…"


def tail(log: str, n: int = 20) -> str:
    return "\n".join(log.rstrip().splitlines()[-n:])


def baseline(patches: list[Patch], level: str, clean: Path, py: str) -> tuple[list[str], set[str]]:
    """The named tests on the clean tree: (what is wrong there, the named tests that did not pass). A test that
    skips there (the long tier outside SUMMIT_TEST_LONG=1) is left out of its patches' runs, not counted wrong."""
    tests = sorted({t for p in patches for t in p.tests.get(level, [])})
    if not tests:
        return [], set()
    outcome = run_tests(clean, tests, py, "clean")
    wrong, unusable = [], set()
    for test in tests:
        cases = claimed(outcome.cases, [test])
        if not cases:
            wrong.append(f"{test}: did not run on the clean tree (pytest exit {outcome.exit_code})")
        failed = [f"{n}: {s} on the clean tree: {short(m)}" for n, (s, m) in cases.items() if s in ("failure", "error")]
        wrong += failed
        if not cases or failed or all(s == "skipped" for s, _ in cases.values()):
            unusable.add(test)
    if wrong and outcome.exit_code not in (0, 1):
        wrong.append(tail(outcome.log))
    return wrong, unusable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--unit", action="store_const", dest="levels", const=["unit"])
    group.add_argument("--engine", action="store_const", dest="levels", const=["engine"])
    group.add_argument("--all", action="store_const", dest="levels", const=["unit", "engine"])
    parser.add_argument("--record", help="write the verdicts (date, commit, per patch) to this JSON file")
    parser.add_argument("--dir", default=str(REPO / "tests" / "mutations"), help="where the patches are")
    parser.add_argument("names", nargs="*")
    ns = parser.parse_args(argv)
    levels = ns.levels or ["unit"]
    py = python_for_tests()
    if subprocess.run([py, "-c", "import pytest"], capture_output=True).returncode != 0:
        print(
            f"mutations: pytest is not installed for {py}: nothing can be checked. Install the test tools "
            "(SUMMIT_EXTRAS=cpu,test bash scripts/setup.sh, as README command 2 does)",
            file=sys.stderr,
        )
        return 2
    directory = Path(ns.dir)
    names = ns.names or sorted(p.stem for p in directory.glob("*.patch"))
    bad, verdicts = 0, []
    patches = []
    for name in names:
        path = directory / f"{name}.patch"
        if not path.is_file():
            print(f"mutation {name}: no such patch ({path})")
            bad = 1
            continue
        patches.append(Patch.read(path))
    with tempfile.TemporaryDirectory(prefix="summit-mutations.") as scratch_dir:
        scratch = Path(scratch_dir)
        clean = scratch / "clean"
        copy_tree(clean)
        if "unit" in levels:
            _forks(py, len(patches))  # warmed once, with what this many patches are worth
        for level in levels:
            missing = [p for p in patches if level not in p.tests and level not in p.why_none]
            for p in missing:
                print(f"mutation {p.name} ({level}): names no tests (`# {level}: TESTS`, or `# {level}: none: WHY`)")
                verdicts.append({"patch": p.name, "level": level, "killed": False, "verdict": "names no tests"})
                bad = 1
            wrong, unusable = baseline(patches, level, clean, py)
            if wrong:
                print(f"mutations ({level}): the named tests do not all pass on the clean tree:")
                print("\n".join(f"  {w}" for w in wrong))
                bad = 1
            for patch in patches:
                named = patch.tests.get(level, [])
                if named and all(t in unusable for t in named):
                    said = "not checked: its tests do not pass (or skip) on the clean tree"
                    print(f"mutation {patch.name} ({level}): {said}")
                    verdicts.append({"patch": patch.name, "level": level, "killed": False, "verdict": said})
                    continue
                if level in patch.why_none:
                    print(f"mutation {patch.name} ({level}): {patch.why_none[level]}")
                    verdicts.append(
                        {"patch": patch.name, "level": level, "killed": None, "verdict": patch.why_none[level]}
                    )
                    continue
                if level not in patch.tests:
                    continue
                tree = scratch / f"{patch.name}-{level}"
                shutil.copytree(clean, tree)
                applied = subprocess.run(["git", "apply", str(patch.path.resolve())], cwd=tree, capture_output=True)
                if applied.returncode != 0:
                    said = f"the patch no longer applies: update {patch.path} ({applied.stderr.decode().strip()})"
                    killed = False
                else:
                    patch.tests[level] = [t for t in patch.tests[level] if t not in unusable]
                    killed, said = verdict(
                        patch, level, run_tests(tree, patch.tests[level], py, patch.name, first_failure=True)
                    )
                print(f"mutation {patch.name} ({level}): {said}", flush=True)
                verdicts.append(
                    {"patch": patch.name, "level": level, "killed": killed, "verdict": said.splitlines()[0]}
                )
                if ns.record:  # as each verdict is reached: a long engine-level run interrupted keeps what it found
                    write_record(Path(ns.record), levels, verdicts[-1:])
                bad |= not killed
                shutil.rmtree(tree, ignore_errors=True)
    if ns.record:
        write_record(Path(ns.record), levels, verdicts)
    return bad


def write_record(path: Path, levels: list[str], verdicts: list[dict]) -> None:
    """The verdicts, each with the date and commit it was reached at, merged into `path`: a run of some patches
    replaces their entries and keeps the others'."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    stamp = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": head + ("+uncommitted changes" if dirty else ""),
    }
    old = json.loads(path.read_text()) if path.exists() else {}
    kept = {(v["patch"], v["level"]): v for v in old.get("verdicts", [])}
    kept.update({(v["patch"], v["level"]): {**v, **stamp} for v in verdicts})
    doc = {
        "command": "bash scripts/mutations.sh --"
        + ("all" if len(levels) == 2 else levels[0])
        + f" --record {path.name}",
        "verdicts": sorted(kept.values(), key=lambda v: (v["level"], v["patch"])),
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(serve_forks(sys.argv[2:]) if sys.argv[1:2] == ["--forks"] else main())
