"""Imports flow one way: cli -> flows -> {workers, agents, trainer, serving} -> reports ->
{memory, verifiers}, and nothing imports cli/ or bench/ (tests aside)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALLOWED = {
    "cli": {
        "cli",
        "flows",
        "workers",
        "reports",
        "agents",
        "trainer",
        "serving",
        "memory",
        "verifiers",
    },
    "flows": {"flows", "workers", "reports", "agents", "trainer", "serving", "memory", "verifiers"},
    "workers": {"workers", "agents", "serving", "memory", "verifiers"},
    "reports": {"reports", "memory", "verifiers"},
    "agents": {"agents", "memory", "verifiers"},
    "trainer": {"trainer", "memory", "verifiers"},
    "serving": {"serving", "reports", "memory", "verifiers"},  # the page shows reports' views
    "memory": {"memory"},
    "verifiers": {"verifiers"},
}


def imported_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & (set(ALLOWED) | {"bench"})


def test_import_direction() -> None:
    violations = []
    for package, allowed in ALLOWED.items():
        for path in (ROOT / package).rglob("*.py"):
            bad = imported_packages(path) - allowed
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert violations == []


def test_only_flows_imports_prefect() -> None:
    for package in set(ALLOWED) - {"flows", "cli"}:
        for path in (ROOT / package).rglob("*.py"):
            assert "prefect" not in {n.split(".")[0] for n in _all_imports(path)}, path


def _all_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


PACKAGES = [*ALLOWED, "bench"]


def test_no_function_takes_more_than_seven_parameters() -> None:
    """Longer lists become records (an endpoint, a group spec, a shift)."""
    long = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    arguments = node.args
                    names = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                    count = len(names) + bool(arguments.vararg) + bool(arguments.kwarg)
                    count -= bool(names) and names[0].arg in ("self", "cls")
                    if count > 7:
                        long.append(f"{path.relative_to(ROOT)}:{node.name} takes {count}")
    assert long == []


def test_nothing_imports_cli_or_bench() -> None:
    for package in set(ALLOWED) - {"cli"}:
        for path in (ROOT / package).rglob("*.py"):
            assert not imported_packages(path) & {"cli", "bench"}, path


BENCH_TESTS = {"test_chaos.py", "test_bench_results.py"}  # and test_*_bench.py: bench's own


def test_only_the_tests_of_bench_import_it() -> None:
    """bench/ measures; nothing depends on it: a test that needs a helper finds it in
    tests/helpers.py, and only bench's own tests import bench."""
    importing = {
        path.name for path in (ROOT / "tests").glob("*.py") if "bench" in imported_packages(path)
    }
    assert {n for n in importing if n not in BENCH_TESTS and not n.endswith("_bench.py")} == set()
