"""Run untrusted Python code (a model's tool call) in a subprocess with limits.

Each run is a fresh ``python -I`` of ``sys.executable`` (isolated: no ``PYTHON*`` variables, no user site, no
script directory on ``sys.path``) in a new session, with:

- its own temporary scratch directory as working directory, ``HOME`` and ``TMPDIR``, removed afterwards;
- a minimal environment (nothing of the trainer's: no tokens, no keys), stdin closed;
- resource limits set by a small bootstrap before the code runs: ``RLIMIT_CPU`` (seconds of CPU),
  ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (largest file written) and ``RLIMIT_NPROC``;
- an audit hook (``sys.addaudithook``, which code cannot remove) that refuses process creation (``os.fork``,
  ``os.system``, ``subprocess.Popen``, ``os.exec*``, ``os.posix_spawn``, ``pty.spawn``), signals to other
  processes (``os.kill``), the network (``socket.connect``/``bind``/``sendto``/``getaddrinfo``...) and writing
  or deleting files outside the scratch directory;
- stdout and stderr read through pipes with a cap: the process is killed once it writes more than
  ``output_bytes`` and only that much is kept;
- a wall-clock limit, after which the process group is killed; and on every exit path (normal exit
  included) ``os.killpg`` of the group, so that nothing the code started is left running.

What this is not: a security boundary against code written to escape. ``RLIMIT_NPROC`` is not enforced for root
(the audit hook is then what refuses process creation), and ``ctypes`` can call the C library directly, past the
audit hook (a process it forks is still in the group and killed at the end, unless it calls ``setsid``). For
hostile code, run the trainer's sandbox inside a container or a user namespace. The limits here are against the
ordinary failures of model-written code: infinite loops, huge allocations, floods of output, stray processes.

Linux only (``resource``, ``os.waitid``, ``os.wait4``).
"""

from __future__ import annotations

import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; each limit ends the run with an error that names it."""

    cpu_s: float = 5.0  # RLIMIT_CPU, rounded up to whole seconds (SIGXCPU, then SIGKILL a second later)
    memory_mb: int = 512  # RLIMIT_AS: the address space, so an allocation over it raises MemoryError
    output_bytes: int = 16_384  # stdout+stderr kept; the process is killed once it writes more than this
    wall_s: float = 10.0  # wall clock, then the whole process group is killed
    file_bytes: int = 16 * 2**20  # RLIMIT_FSIZE: the largest file the code may write (OSError past it)
    # RLIMIT_NPROC (None: not set). 0 refuses forks for a user other than root; Linux counts threads too, so
    # the code cannot start threads either. Root is exempt, which is why the audit hook also refuses them.
    processes: int | None = 0


@dataclass
class SandboxResult:
    """What a run printed, and why it failed (``error`` is None when it exited with status 0)."""

    stdout: str
    stderr: str
    # one short line: "timed out after 10 s (wall)", "CPU limit of 5 s", "memory limit of 512 MB",
    # "output over 16384 bytes", "exit code 1: <last line of stderr>", "killed by signal 11 (SIGSEGV)"
    error: str | None


# Run in the child with ``-c``: set the limits, install the audit hook, then run the code (read from the file
# named in the configuration) as ``__main__``. A traceback leaves out the bootstrap's own frame.
_BOOTSTRAP = r"""
import json, linecache, os, resource, signal, sys, traceback

_cfg = json.loads(sys.argv[1])
sys.argv = ["<sandbox>"]


def _limit(res, soft, hard):
    _, cap = resource.getrlimit(res)
    if cap != resource.RLIM_INFINITY:
        soft, hard = min(soft, cap), min(hard, cap)
    resource.setrlimit(res, (soft, hard))


_limit(resource.RLIMIT_CPU, _cfg["cpu"], _cfg["cpu"] + 1)
_limit(resource.RLIMIT_AS, _cfg["memory"], _cfg["memory"])
_limit(resource.RLIMIT_FSIZE, _cfg["fsize"], _cfg["fsize"])
if _cfg["nproc"] is not None:
    _limit(resource.RLIMIT_NPROC, _cfg["nproc"], _cfg["nproc"])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file over the limit: OSError (EFBIG) instead of a kill

with open(_cfg["code"], encoding="utf-8") as _f:
    _src = _f.read()
linecache.cache["<sandbox>"] = (len(_src), None, _src.splitlines(True), "<sandbox>")

_BLOCKED = frozenset({
    "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.system", "subprocess.Popen",
    "_posixsubprocess.fork_exec", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill",
    "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
})
# events that change the file system: the indices of their path arguments, which must lie in the scratch dir
_WRITES = {
    "os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,), "os.chown": (0,),
    "os.truncate": (0,), "os.utime": (0,), "shutil.rmtree": (0,), "os.rename": (0, 1), "os.link": (0, 1),
    "os.symlink": (1,), "os.mkfifo": (0,), "os.mknod": (0,),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_SCRATCH = os.path.realpath(_cfg["scratch"])
_realpath, _fspath, _fsdecode, _sep = os.path.realpath, os.fspath, os.fsdecode, os.sep


def _inside(path):
    if isinstance(path, int):
        return True  # a file descriptor: opened (and checked) already
    try:
        real = _fsdecode(_realpath(_fspath(path)))
    except Exception:
        return False
    return real == _SCRATCH or real.startswith(_SCRATCH + _sep) or real == "/dev/null"


def _hook(event, args):
    if event in _BLOCKED:
        raise PermissionError("sandbox: " + event + " is not allowed")
    if event == "open":
        if args[2] & _WRITE_FLAGS and not _inside(args[0]):
            raise PermissionError("sandbox: writing outside the scratch directory is not allowed: %r" % (args[0],))
    elif event in _WRITES:
        for i in _WRITES[event]:
            if i < len(args) and not _inside(args[i]):
                raise PermissionError("sandbox: %s outside the scratch directory is not allowed: %r" % (event, args[i]))


sys.addaudithook(_hook)
del _f, _limit, _cfg
try:
    exec(compile(_src, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _err:
    traceback.print_exception(type(_err), _err, _err.__traceback__.tb_next if _err.__traceback__ else None)
    sys.exit(1)
"""

_READ_CHUNK = 65_536
_DRAIN_S = 2.0  # after the kill, how long to wait for the pipes to close (a process that left the group)
_POLL_S = 0.05  # how often the read loop checks whether the code has exited (its children may hold the pipes)


def _environment(scratch: str) -> dict[str, str]:
    """A minimal environment: nothing inherited but a plain ``PATH``."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": scratch,
        "TMPDIR": scratch,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # libraries that start a thread pool at import (numpy's BLAS) would fail under RLIMIT_NPROC
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _exited(pid: int) -> bool:
    """Whether the process has exited, without reaping it (its pid keeps the process group's id taken)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if len(line) <= 200 else line[:197] + "..."


def _describe(returncode: int, cpu_used: float, stderr: str, limits: SandboxLimits, cpu_limit: int) -> str | None:
    """The error line of a process that ended by itself (not killed by the sandbox for wall time or output)."""
    if returncode == 0:
        return None
    if returncode < 0:
        signum = -returncode
        if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu_used >= cpu_limit):
            return f"CPU limit of {limits.cpu_s:g} s"
        try:
            name = signal.Signals(signum).name
        except ValueError:
            return f"killed by signal {signum}"
        return f"killed by signal {signum} ({name})"
    last = _last_line(stderr)
    if last == "MemoryError" or last.startswith("MemoryError:"):
        return f"memory limit of {limits.memory_mb} MB"
    return f"exit code {returncode}: {last}" if last else f"exit code {returncode}"


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in a fresh, limited Python process; see the module docstring for what is limited and how."""
    root = tempfile.mkdtemp(prefix="gcore-sandbox-")
    scratch = os.path.join(root, "scratch")
    os.mkdir(scratch)
    code_path = os.path.join(root, "main.py")  # outside the scratch dir: the code cannot change it
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    cpu_limit = max(1, math.ceil(limits.cpu_s))
    config = {
        "cpu": cpu_limit,
        "memory": limits.memory_mb * 2**20,
        "fsize": limits.file_bytes,
        "nproc": limits.processes,
        "code": code_path,
        "scratch": scratch,
    }
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-u", "-X", "utf8", "-c", _BOOTSTRAP, json.dumps(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=scratch,
            env=_environment(scratch),
            start_new_session=True,
        )
        return _supervise(proc, limits, cpu_limit)
    finally:
        if proc is not None:
            if proc.returncode is None:  # _supervise did not get to its kill and reap (it raised)
                _kill_group(proc.pid)
                proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        shutil.rmtree(root, ignore_errors=True)


def _supervise(proc: subprocess.Popen[bytes], limits: SandboxLimits, cpu_limit: int) -> SandboxResult:
    """Read the output with its cap until the code exits or a limit is hit; kill the group; reap; describe."""
    assert proc.stdout is not None and proc.stderr is not None
    chunks: dict[int, list[bytes]] = {proc.stdout.fileno(): [], proc.stderr.fileno(): []}
    kept = 0
    killed: str | None = None
    deadline = time.monotonic() + limits.wall_s
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)

        def read_ready(timeout: float) -> None:
            nonlocal kept, killed
            for key, _ in selector.select(timeout):
                fd = int(key.fd)
                data = os.read(fd, _READ_CHUNK)
                if not data:
                    selector.unregister(fd)
                    continue
                room = limits.output_bytes - kept
                chunks[fd].append(data[: max(room, 0)])
                kept += min(len(data), max(room, 0))
                if len(data) > room:
                    killed = f"output over {limits.output_bytes} bytes"
                    return

        exited = False
        while selector.get_map() and killed is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                killed = f"timed out after {limits.wall_s:g} s (wall)"
                break
            read_ready(min(remaining, _POLL_S))
            if _exited(proc.pid):  # its children (if any got through) may hold the pipes open: stop waiting
                exited = True
                break
        if not exited and killed is None and not selector.get_map():  # both pipes closed: wait for the exit
            while not _exited(proc.pid):
                if time.monotonic() >= deadline:
                    killed = f"timed out after {limits.wall_s:g} s (wall)"
                    break
                time.sleep(_POLL_S)
        _kill_group(proc.pid)  # the leader is not reaped yet, so the group id cannot have been reused
        drain_until = time.monotonic() + _DRAIN_S
        while killed is None and selector.get_map() and time.monotonic() < drain_until:
            read_ready(_POLL_S)  # what was still in the pipes when the code exited
    try:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        cpu_used = usage.ru_utime + usage.ru_stime
    except ChildProcessError:  # reaped by someone else
        proc.wait()
        cpu_used = 0.0
    stdout = b"".join(chunks[proc.stdout.fileno()]).decode("utf-8", errors="replace")
    stderr = b"".join(chunks[proc.stderr.fileno()]).decode("utf-8", errors="replace")
    error = killed or _describe(proc.returncode, cpu_used, stderr, limits, cpu_limit)
    return SandboxResult(stdout, stderr, error)
