import json
import os
from pathlib import Path

# Tests run on loopback with auth off, whatever the developer's shell says (see FACTS: token auth turns itself on).
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Settings of the test clusters only, not Summit's defaults (README command 1's test runs without them):
TEST_CLUSTER_ENV = {
    # Serve's control loop every 0.5 s (Serve's default: 0.1 s): an idle one-app cluster then used 5.4 CPU-s a minute
    # instead of 8.5-11.3 (tests/README.md), and the suite runs up to four clusters at once on 2 cores. Serve's
    # autoscaling delays are in seconds whatever the interval. Benchmarks keep Serve's default.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # the engines' queue readers spin 0.1 s after a read, not vLLM's 1 s (deployments/engine/platform.py): the suite's
    # engines answer a request now and then, and each answer cost a worker a second of a core; under load it costs a
    # CPU engine throughput (tests/README.md)
    "SUMMIT_ENGINE_SPIN_S": "0.1",
}
for _name, _value in TEST_CLUSTER_ENV.items():
    os.environ.setdefault(_name, _value)


import openai  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def client(summit) -> openai.OpenAI:
    """The official client against the `summit` fixture of the suite (tests/cpu or tests/gpu)."""
    return openai.OpenAI(base_url=summit.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(summit) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=summit.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


SESSION_APP = "summit"  # tests/cpu/conftest.py's session fixture: one cluster, one engine
# The modules that use it (checked at collection: a module that starts or stops using it must be listed or removed)
SESSION_APP_MODULES = {
    "tests/cpu/test_abort.py",
    "tests/cpu/test_batch.py",
    "tests/cpu/test_errors.py",
    "tests/cpu/test_fuzz.py",
    "tests/cpu/test_openai_api.py",
    "tests/cpu/test_z_engine_failure.py",
}
_LAST_SESSION_TEST = pytest.StashKey[bool]()

# The modules that take longest start first, so that the test command's workers (pytest-xdist) finish together; the
# order changes nothing else. It comes from a fresh-clone run's JUnit XML (scripts/test.sh writes one under the run's
# temp dir; `python scripts/suite_times.py RUN.xml --order tests/module_order.json` rewrites the file).
SLOWEST_FIRST = json.loads((Path(__file__).parent / "module_order.json").read_text())["slowest_first"]


LONG_TIER = os.environ.get("SUMMIT_TEST_LONG") == "1"


def pytest_collection_modifyitems(session, config, items):
    """The modules that use the session app run first (in their order: test_z_engine_failure, which kills its engine,
    last among them); the session cluster is stopped after its last test instead of idling beside every later
    module's cluster (≈ 17 % of a core, measured). The other modules follow, slowest first. Tests of the long tier
    (marked `long`) are skipped unless SUMMIT_TEST_LONG=1."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)
    uses = [
        m
        for m, its in modules.items()
        if its[0].nodeid.startswith("tests/cpu/") and any(SESSION_APP in it.fixturenames for it in its)
    ]  # tests/gpu has a session app of its own, of the same fixture name
    unlisted = {its[0].nodeid.split("::")[0] for m, its in modules.items() if m in uses} - SESSION_APP_MODULES
    if unlisted:
        raise pytest.UsageError(f"{sorted(unlisted)} use the session app: add them to SESSION_APP_MODULES")
    rest = [m for m in modules if m not in uses]

    def rank(module) -> int:
        name = module.__name__.removeprefix("tests.").replace(".", "/")
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    if not LONG_TIER:  # reported as skipped, with how to run them
        long = pytest.mark.skip(reason="the long tier: SUMMIT_TEST_LONG=1 bash scripts/test.sh (tests/README.md)")
        for it in items:
            if "long" in it.keywords:
                it.add_marker(long)
    rest.sort(key=rank)  # stable: the others keep their collection order
    items[:] = [it for m in uses + rest for it in modules[m]]
    last = [it for m in uses for it in modules[m] if SESSION_APP in it.fixturenames][-1:]
    for it in last:
        it.stash[_LAST_SESSION_TEST] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if item.stash.get(_LAST_SESSION_TEST, False):
        from tests.cpu.conftest import stop_session_app

        stop_session_app()


def pytest_xdist_make_scheduler(config, log):
    """The test command's workers (scripts/test.sh: pytest-xdist) take whole modules, in collection order, and
    the session app's modules as one unit, so that each module's app, and the session app, start once."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "session-app" if path in SESSION_APP_MODULES else path

    return ModuleScheduling(config, log)


def _repository_changes() -> set[str]:
    """The repository's untracked files (`git status`: a file a test left in it shows here; ignored ones do not)."""
    import subprocess

    run = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
    )
    return {line for line in run.stdout.splitlines() if line.startswith("??")} if run.returncode == 0 else set()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):  # the controller (or the only process), once
        session.config._summit_repo_before = _repository_changes()


def pytest_sessionfinish(session, exitstatus):
    """No test writes into the repository: what the run added to `git status` fails it, named."""
    before = getattr(session.config, "_summit_repo_before", None)
    if before is None:
        return
    added = sorted(_repository_changes() - before)
    if added:
        print(f"\nthe tests wrote into the repository (write under tmp_path instead): {added}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
