"""The sandbox of the ``python`` tool: each limit ends a run with its own error, and nothing is left behind (no
process, no scratch directory). No test asserts on wall time: limits are generous where the machine's load could
make them fire by accident. The attacks of the 2026-11-28 review are in test_sandbox_escapes.py; what happens
without bubblewrap is at the end of this file.

The tests run under bubblewrap (``sandbox="bwrap"``, the default) and skip where it cannot run; the ones
marked with ``both`` also run with ``sandbox="none"`` (the documented unsafe option), whose normal behaviour must
stay the same."""

import os
import textwrap
import uuid

import pytest
from conftest import processes_with

from gcore.envs.sandbox import SandboxLimits, run_python

psutil = pytest.importorskip("psutil")
pytestmark = pytest.mark.usefixtures("needs_bwrap")
both = pytest.mark.parametrize("sandbox", ["bwrap", "none"])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@both
def test_a_normal_run_returns_its_output_and_no_error(sandbox):
    result = run_python("print(2 + 3)", sandbox=sandbox)
    assert (result.stdout, result.stderr, result.error) == ("5\n", "", None)


@both
def test_stderr_and_a_raised_exception_end_as_an_exit_code_error_naming_it(sandbox):
    result = run_python("import sys\nprint('out')\nprint('warn', file=sys.stderr)\nraise ValueError('bad value')",
                        sandbox=sandbox)
    assert result.stdout == "out\n"
    assert "warn" in result.stderr and "ValueError: bad value" in result.stderr
    assert result.error == "exit code 1: ValueError: bad value"


def test_a_syntax_error_is_an_exit_code_error_naming_the_syntax_error():
    result = run_python("x = (")
    assert result.error is not None
    assert result.error.startswith("exit code 1: SyntaxError")


@both
def test_sys_exit_codes_pass_through(sandbox):
    assert run_python("import sys; sys.exit(0)", sandbox=sandbox).error is None
    assert run_python("import sys; sys.exit(3)", sandbox=sandbox).error == "exit code 3"
    assert run_python("import os; os._exit(3)", sandbox=sandbox).error == "exit code 3"


@both
def test_a_crash_by_a_signal_is_named(sandbox):
    """Under bubblewrap the code's signal reaches gcore as bwrap's exit status 128 + N: still named."""
    result = run_python("import os, signal\nos.abort()", sandbox=sandbox)
    assert result.error == "killed by signal 6 (SIGABRT)"


@both
def test_an_infinite_loop_ends_at_the_cpu_limit(sandbox):
    result = run_python("while True:\n    pass", SandboxLimits(cpu_s=1, wall_s=30), sandbox=sandbox)
    assert result.error == "CPU limit of 1 s"


@both
def test_sleeping_past_the_wall_clock_limit_is_killed(sandbox):
    """The wall-clock limit counts from the process's start, so it must leave the interpreter time to start and
    print: beside a busy neighbour and two test processes, 1 s was not always enough to reach the print."""
    result = run_python("import time\nprint('started')\ntime.sleep(1000)", SandboxLimits(wall_s=5), sandbox=sandbox)
    assert result.error == "timed out after 5 s (wall)"
    assert result.stdout == "started\n"  # what was printed before the kill is kept


@both
def test_allocating_10_gb_is_a_memory_error(sandbox):
    result = run_python("block = bytearray(10 * 1024**3)", SandboxLimits(memory_mb=512), sandbox=sandbox)
    assert result.error == "memory limit of 512 MB"


@pytest.mark.parametrize("code", [
    "while True:\n    print('x' * 1000)",
    "import sys\nsys.stdout.write('y' * 10_000_000)",
    "import sys\nwhile True:\n    sys.stderr.write('z' * 4096)",
])
@both
def test_printing_too_much_is_an_output_error_and_keeps_at_most_the_cap(code, sandbox):
    limits = SandboxLimits(output_bytes=4096, wall_s=30)
    result = run_python(code, limits, sandbox=sandbox)
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
@both
def test_starting_a_process_is_an_error_and_leaves_nothing_running(call, sandbox):
    marker = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"  # a unique `sleep` argument
    result = run_python(call.format(marker=marker), SandboxLimits(wall_s=30), sandbox=sandbox)
    assert result.error is not None
    assert "PermissionError: sandbox:" in result.error, result.stderr
    assert processes_with(f"sleep {marker}") == []


def test_with_no_processes_allowed_even_ctypes_cannot_fork_but_threads_run():
    """processes=0 (the default): bubblewrap's seccomp filter refuses fork/clone past the audit hook (ctypes),
    for root too; threads still start."""
    code = textwrap.dedent("""
        import ctypes, os, threading
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.fork(), ctypes.get_errno())
        seen = []
        t = threading.Thread(target=seen.append, args=("thread ran",))
        t.start(); t.join()
        print(seen[0])
    """)
    result = run_python(code, SandboxLimits(wall_s=60))
    assert result.error is None, result.stderr
    assert result.stdout.split("\n")[:2] == ["-1 1", "thread ran"]  # fork: -1, errno EPERM


def test_a_child_that_gets_past_the_audit_hook_is_killed_with_the_sandbox():
    """With processes allowed, ctypes forks past the audit hook. The child sleeps holding stdout open: the run
    must still end when the code does (not at the wall limit), and the child must be gone after."""
    name = f"gc{uuid.uuid4().hex[:12]}"  # the child's process name (at most 15 characters), to find it by
    code = textwrap.dedent(f"""
        import ctypes, os, sys, time
        libc = ctypes.CDLL(None)
        pid = libc.fork()
        if pid == 0:
            libc.prctl(15, {name.encode()!r})  # PR_SET_NAME
            time.sleep(1000)
            os._exit(0)
        time.sleep(1)  # the child has named itself
        print(pid)
    """)
    result = run_python(code, SandboxLimits(wall_s=60, processes=4))
    assert result.error is None, result.stderr
    assert int(result.stdout) > 0  # it did fork (its pid in the sandbox's own PID namespace)
    assert _named(name) == []


def _named(name: str) -> list:
    """Live (not zombie) processes called ``name``."""
    found = []
    for proc in psutil.process_iter(["name", "status"]):
        if proc.info["name"] == name and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


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


@both
def test_files_go_to_a_scratch_dir_that_the_next_run_does_not_see(sandbox, tmp_path):
    code = textwrap.dedent("""
        import os
        print(sorted(os.listdir(".")))
        with open("note.txt", "w") as f:
            f.write("kept for this run only")
        print(os.getcwd())
        print(os.path.abspath("note.txt"))
        print(os.environ["HOME"])
        print(os.environ["TMPDIR"])
    """)
    first = run_python(code, sandbox=sandbox)
    assert first.error is None, first.stderr
    listing, cwd, note, home, tmpdir = first.stdout.split("\n")[:5]
    assert listing == "[]" and note == os.path.join(cwd, "note.txt") and home == cwd == tmpdir
    second = run_python(code, sandbox=sandbox)
    assert second.error is None and second.stdout.split("\n")[0] == "[]"  # nothing kept between calls
    if sandbox == "none":  # a folder of the host's temporary folder, removed afterwards
        assert not os.path.exists(cwd) and not os.path.exists(os.path.dirname(cwd))


def test_the_scratch_space_is_limited():
    """bwrap: /scratch (the scratch) is a tmpfs of scratch_mb; filling it is ENOSPC, not the host's disk or memory."""
    code = "for i in range(10):\n    open(f'f{i}', 'wb').write(b'0' * 4_000_000)"
    result = run_python(code, SandboxLimits(scratch_mb=8, file_bytes=5_000_000))
    assert result.error is not None and "No space left on device" in result.error, result.stderr


@both
def test_writing_or_deleting_outside_the_scratch_dir_is_refused(tmp_path, sandbox):
    """The audit hook (the second layer under bubblewrap, the only one without) names the refusal of a path
    outside the scratch; under bubblewrap the host's folder is not even there (/tmp is the sandbox's own)."""
    refused = ("outside the scratch directory",) if sandbox == "none" else ("outside the scratch directory",
                                                                           "FileNotFoundError")
    target = tmp_path / "outside.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", sandbox=sandbox)
    assert result.error is not None and any(r in result.error for r in refused), result.error
    assert not target.exists()
    target.write_text("keep me")
    for code in (f"import os\nos.remove({str(target)!r})", f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
                 "open('/usr/gcore-sandbox-test', 'w')", "import os\nos.mkdir('/gcore-sandbox-test')"):
        result = run_python(code, sandbox=sandbox)
        assert result.error is not None and any(r in result.error for r in refused), result.error
    assert target.read_text() == "keep me"
    assert not os.path.exists("/usr/gcore-sandbox-test") and not os.path.exists("/gcore-sandbox-test")
    # system paths exist in the sandbox: the hook is what names the refusal
    result = run_python("open('/usr/gcore-sandbox-test', 'w')", sandbox=sandbox)
    assert result.error is not None and "outside the scratch directory" in result.error
    read = run_python(f"print(open({str(target)!r}).read())", sandbox=sandbox)
    if sandbox == "none":
        assert read.stdout == "keep me\n"  # without isolation the code reads what the trainer can
    else:
        assert read.error is not None and "FileNotFoundError" in read.error  # not in the sandbox's file system


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
