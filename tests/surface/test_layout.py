"""The tests mirror the package: every test file lives in a folder named after the part of gcore it tests
(tests/algorithms/, tests/backends/, ...), and a file that starts processes marks those tests ``integration``."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

#: what starts another process in these tests: a CLI run, spawned ranks, a child process, engine workers
STARTS_PROCESSES = re.compile(r"\brun_gcore\(|\bgcore_cli\b|\bspawn\(|\bsubprocess\.|\bWorkerPool\(")


def test_every_test_file_lives_in_a_subfolder():
    loose = sorted(p.name for p in TESTS.glob("*.py") if p.name != "conftest.py")
    assert not loose, f"move {loose} into the tests/ folder of the part of gcore they test"


def test_basenames_are_unique_and_conftest_is_only_at_the_root():
    # no __init__.py: pytest imports each file under its basename, and `from conftest import ...` must find the
    # root conftest.py, which a conftest.py in a subfolder would shadow
    files = sorted(TESTS.rglob("*.py"))
    nested = [p.relative_to(TESTS).as_posix() for p in files if p.parent != TESTS and p.name in
              ("conftest.py", "__init__.py")]
    assert not nested, nested
    names = [p.name for p in files if p.name.startswith("test_")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_files_that_start_processes_mark_them_integration():
    unmarked = [p.relative_to(TESTS).as_posix() for p in sorted(TESTS.rglob("test_*.py"))
                if p != Path(__file__).resolve() and STARTS_PROCESSES.search(p.read_text())
                and "pytest.mark.integration" not in p.read_text()]
    assert not unmarked, f"{unmarked} start processes: mark those tests with pytest.mark.integration"
