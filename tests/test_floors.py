"""The floors below the harness and the report: `records/` (what a run writes) and `stats/` (the intervals and the
tolerance rule) import neither `ab/` nor `report/`, so both stand on them and neither stands on the other for them;
`stats/` knows no record either."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "kvevict"
#: floor -> packages it must never import
FLOORS = {
    "records": ("kvevict.ab", "kvevict.report", "kvevict.cli", "kvevict.integrations"),
    "stats": ("kvevict.ab", "kvevict.report", "kvevict.cli", "kvevict.integrations", "kvevict.records"),
}


def _imported(path: Path, package: str) -> set[str]:
    """Absolute names of the modules `path` (a module of `kvevict.<package>`) imports, relative ones resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = {0: "", 1: f"kvevict.{package}", 2: "kvevict"}[node.level]
            module = ".".join(filter(None, [base, node.module or ""]))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_a_floor_never_imports_what_stands_on_it(floor):
    files = sorted((SRC / floor).glob("*.py"))
    assert files
    for path in files:
        bad = {n for n in _imported(path, floor) if n.startswith(FLOORS[floor])}
        assert not bad, f"{floor}/{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize("floor", sorted(FLOORS))
def test_importing_a_floor_loads_nothing_above_it(floor):
    modules = ", ".join(f"kvevict.{floor}.{p.stem}" for p in sorted((SRC / floor).glob("*.py"))
                        if p.stem != "__init__")
    probe = (f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith({FLOORS[floor]!r})))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
