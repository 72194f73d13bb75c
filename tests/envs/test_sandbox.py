"""The subprocess sandbox of the ``python`` tool: each limit ends a run with its own error, and nothing is left
behind (no process, no scratch directory). No test asserts on wall time: limits are generous where the machine's
load could make them fire by accident."""

import os
import textwrap
import uuid

import pytest

from gcore.envs.sandbox import SandboxLimits, run_python

psutil = pytest.importorskip("psutil")


def _processes_with(marker: str) -> list:
    """Live (not zombie) processes whose command line mentions ``marker``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_normal_run_returns_its_output_and_no_error():
    result = run_python("print(2 + 3)")
    assert (result.stdout, result.stderr, result.error) == ("5\n", "", None)


def test_stderr_and_a_raised_exception_end_as_an_exit_code_error_naming_it():
    result = run_python("import sys\nprint('out')\nprint('warn', file=sys.stderr)\nraise ValueError('bad value')")
    assert result.stdout == "out\n"
    assert "warn" in result.stderr and "ValueError: bad value" in result.stderr
    assert result.error == "exit code 1: ValueError: bad value"


def test_a_syntax_error_is_an_exit_code_error_naming_the_syntax_error():
    result = run_python("x = (")
    assert result.error is not None
    assert result.error.startswith("exit code 1: SyntaxError")


def test_sys_exit_codes_pass_through():
    assert run_python("import sys; sys.exit(0)").error is None
    assert run_python("import sys; sys.exit(3)").error == "exit code 3"


def test_an_infinite_loop_ends_at_the_cpu_limit():
    result = run_python("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert result.error == "CPU limit of 1 s"


def test_sleeping_past_the_wall_clock_limit_is_killed():
    """The wall-clock limit counts from the process's start, so it must leave the interpreter time to start and
    print: beside a busy neighbour and two test processes, 1 s was not always enough to reach the print."""
    result = run_python("import time\nprint('started')\ntime.sleep(1000)", SandboxLimits(wall_s=5))
    assert result.error == "timed out after 5 s (wall)"
    assert result.stdout == "started\n"  # what was printed before the kill is kept


def test_allocating_10_gb_is_a_memory_error():
    result = run_python("block = bytearray(10 * 1024**3)", SandboxLimits(memory_mb=512))
    assert result.error == "memory limit of 512 MB"


@pytest.mark.parametrize("code", [
    "while True:\n    print('x' * 1000)",
    "import sys\nsys.stdout.write('y' * 10_000_000)",
    "import sys\nwhile True:\n    sys.stderr.write('z' * 4096)",
])
def test_printing_too_much_is_an_output_error_and_keeps_at_most_the_cap(code):
    limits = SandboxLimits(output_bytes=4096, wall_s=30)
    result = run_python(code, limits)
    assert result.error == "output over 4096 bytes"
    kept = len(result.stdout.encode()) + len(result.stderr.encode())
    assert 0 < kept <= 4096


@pytest.mark.parametrize("call", [
    "import os\nos.fork()",
    "import os\nos.system('sleep {marker}')",
    "import subprocess\nsubprocess.Popen(['sleep', '{marker}'])",
    "import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])",
    "import os\nos.posix_spawn('/bin/sleep', ['sleep', '{marker}'], {{}})",
    "import multiprocessing\nmultiprocessing.Process(target=print).start()",
])
def test_starting_a_process_is_an_error_and_leaves_nothing_running(call):
    marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"  # a unique `sleep` argument
    result = run_python(call.format(marker=marker), SandboxLimits(wall_s=30))
    assert result.error is not None
    assert "PermissionError: sandbox:" in result.error, result.stderr
    assert _processes_with(f"sleep {marker}") == []


def test_a_child_that_gets_past_the_audit_hook_is_killed_with_the_group():
    """ctypes forks past the audit hook (and past RLIMIT_NPROC for root). The child sleeps holding stdout open:
    the run must still end when the code does (not at the wall limit), and the child must be gone after."""
    code = textwrap.dedent("""
        import ctypes, os, sys, time
        pid = ctypes.CDLL(None).fork()
        if pid == 0:
            time.sleep(1000)
            os._exit(0)
        print(pid)
    """)
    result = run_python(code, SandboxLimits(wall_s=60))
    if result.stdout.strip() in ("", "-1"):
        pytest.skip(f"fork refused here (RLIMIT_NPROC for a user other than root): {result.error}")
    assert result.error is None, result.stderr
    pid = int(result.stdout)
    assert not _alive(pid)


def test_network_connections_are_refused():
    for code in (
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))",
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))",
        "import socket\nsocket.getaddrinfo('example.com', 80)",
    ):
        result = run_python(code)
        assert result.error is not None and "PermissionError: sandbox: socket." in result.error, result.stderr


def test_signals_to_other_processes_are_refused():
    result = run_python("import os, signal\nos.kill(os.getppid(), signal.SIGTERM)")
    assert result.error is not None and "os.kill is not allowed" in result.error


def test_files_go_to_a_scratch_dir_that_is_removed_afterwards(tmp_path):
    code = textwrap.dedent("""
        import os
        with open("note.txt", "w") as f:
            f.write("kept for this run only")
        print(os.getcwd())
        print(os.path.abspath("note.txt"))
        print(os.environ["HOME"])
    """)
    result = run_python(code)
    assert result.error is None, result.stderr
    cwd, note, home = result.stdout.split()
    assert note == os.path.join(cwd, "note.txt") and home == cwd
    assert not os.path.exists(cwd) and not os.path.exists(os.path.dirname(cwd))


def test_writing_or_deleting_outside_the_scratch_dir_is_refused(tmp_path):
    target = tmp_path / "outside.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert result.error is not None and "outside the scratch directory" in result.error
    assert not target.exists()
    target.write_text("keep me")
    for code in (f"import os\nos.remove({str(target)!r})", f"import shutil\nshutil.rmtree({str(tmp_path)!r})"):
        result = run_python(code)
        assert result.error is not None and "outside the scratch directory" in result.error
    assert target.read_text() == "keep me"
    assert run_python(f"print(open({str(target)!r}).read())").stdout == "keep me\n"  # reading is allowed


def test_a_file_over_the_size_limit_cannot_be_written():
    code = "open('big.bin', 'wb').write(b'0' * 100_000)"
    result = run_python(code, SandboxLimits(file_bytes=10_000))
    assert result.error is not None and "File too large" in result.error


def test_the_trainers_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("GCORE_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))\nprint(os.environ.get('GCORE_TEST_SECRET'))")
    assert result.error is None
    assert "GCORE_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout


def test_stdin_is_closed():
    result = run_python("import sys\nprint(repr(sys.stdin.read()))")
    assert result.stdout == "''\n"


def test_runs_from_several_threads_at_once_keep_their_own_output():
    """``call_tool`` runs tools in threads, so several sandboxes may run at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})"), range(8)))
    assert [(r.stdout, r.error) for r in results] == [(f"{i * i}\n", None) for i in range(8)]
