"""Run untrusted Python code (a model's tool call) in a sandbox with limits.

Two ways to run it (``sandbox=``):

``"bwrap"`` (the default): the code runs under bubblewrap (``bwrap``, Debian package ``bubblewrap``, 0.8 or later),
which puts it in namespaces of its own, so that the kernel, not the code's good will, keeps it in:

- user namespace: the code runs as uid/gid 65534 with no capabilities, and cannot make user namespaces of its
  own (``--disable-userns``);
- PID namespace: it sees and can signal only its own processes (no gcore process, not the trainer);
  ``/proc`` is a fresh one of that namespace, so no other process's environment, command line or memory map;
- network namespace: no network at all (a loopback device of its own);
- IPC and UTS namespaces of its own;
- mount namespace: a read-only file system made of ``/usr``, the ``/lib*``, ``/bin``, ``/sbin`` links, the
  dynamic linker's files in ``/etc`` and the running Python installation (``sys.prefix``, ``sys.base_prefix``);
  a fresh ``/dev`` (read-only, ``null``, ``zero``, ``random``... and an empty ``/dev/shm`` of ``scratch_mb``);
  one writable folder, ``/scratch``, a tmpfs of ``scratch_mb`` that is the working directory, ``HOME`` and
  ``TMPDIR``, with ``/tmp`` a link to it (unless the Python installation lies under ``/tmp``, as a CI's virtual
  environment may: then ``/tmp`` holds that installation, read-only); the code itself read-only in
  ``/sandbox/main.py``. No home folder, no project folder, no host ``/tmp`` or ``/dev/shm``;
- a clean environment (bubblewrap itself starts with nothing of the trainer's: its ``/proc/1/environ`` is
  visible inside);
- ``--die-with-parent`` and ``--new-session``: when the sandbox's first process ends, or bubblewrap is killed,
  the kernel kills every process in its PID namespace, ``setsid`` or not;
- with ``processes=0`` (the default) a seccomp filter refuses ``fork``, ``vfork``, ``clone`` without
  ``CLONE_THREAD`` and ``clone3`` (x86-64 and aarch64): threads work, new processes do not, even for a trainer
  run as root (which ``RLIMIT_NPROC`` does not bind).

``"none"``: a plain subprocess (``python -I`` in a new session, a scratch directory of the host's temporary
folder, a minimal environment). No isolation: the audit hook below is all that stands between the code and the
trainer's files and processes, and pure Python gets past it. Only for code you trust.

In both, before the code runs, a small bootstrap sets resource limits: ``RLIMIT_CPU`` (seconds of CPU),
``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (largest file written), ``RLIMIT_NPROC``; and installs an audit hook
(``sys.addaudithook``) that refuses process creation, signals, the network and writes outside the scratch
directory with a readable ``PermissionError: sandbox: ...`` (a second layer, and the only one with ``"none"``).
stdout and stderr are read through pipes with a cap (the run is killed once it writes more than
``output_bytes``); after ``wall_s`` of wall clock the run is killed: bubblewrap's process group with ``SIGKILL``,
and with it, through its PID namespace, every descendant.

Not protected against (``"bwrap"``): a kernel bug reachable from an unprivileged user namespace; reading the
read-only system paths and the Python installation (they hold no secrets of gcore's); CPU and memory
use up to the limits (several sandboxes at once add up); the uid 65534 of the sandbox is, outside its user
namespace, the trainer's own user (bubblewrap maps it so), which matters only through what is mounted, and
nothing of the trainer's is.

Linux only (``resource``, ``os.waitid``, ``os.wait4``, ``os.memfd_create``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

#: the ways to run code: ``bwrap`` (isolated; the default) and ``none`` (a plain subprocess: unsafe)
SANDBOXES = ("bwrap", "none")
#: environment variable naming the bubblewrap executable (a name looked up on ``PATH``, or a path)
BWRAP_ENV = "GCORE_BWRAP"
#: the option that runs the ``python`` tool without isolation (named in the messages)
UNSAFE_OPTION = "--env.python_sandbox none"


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot make a sandbox here; the message is one line saying what to do."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use; each limit ends the run with an error that names it."""

    cpu_s: float = 5.0  # RLIMIT_CPU, rounded up to whole seconds (SIGXCPU, then SIGKILL a second later)
    memory_mb: int = 512  # RLIMIT_AS: the address space, so an allocation over it raises MemoryError
    output_bytes: int = 16_384  # stdout+stderr kept; the process is killed once it writes more than this
    wall_s: float = 10.0  # wall clock, then the sandbox (every process in it) is killed
    file_bytes: int = 16 * 2**20  # RLIMIT_FSIZE: the largest file the code may write (OSError past it)
    # How many processes the code may start. 0: none (with bwrap a seccomp filter refuses them, threads still
    # work; with "none" RLIMIT_NPROC 0, which also refuses threads and does not bind root). N > 0: RLIMIT_NPROC
    # (with bwrap it counts the sandbox's own processes and threads, its init and the code included; Linux does
    # not apply it to a trainer run as root). None: no limit. The audit hook refuses process creation in any case.
    processes: int | None = 0
    scratch_mb: int = 64  # bwrap: the size of the writable /scratch (and of /dev/shm), in memory; over it: ENOSPC


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
_PATH = "/usr/local/bin:/usr/bin:/bin"
_INSIDE_SCRATCH = "/scratch"  # bwrap: the writable folder, as the code sees it (/tmp links to it)
_INSIDE_CODE = "/sandbox/main.py"  # bwrap: the code, read-only


def _environment(scratch: str) -> dict[str, str]:
    """A minimal environment: nothing inherited but a plain ``PATH``."""
    return {
        "PATH": _PATH,
        "HOME": scratch,
        "TMPDIR": scratch,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # libraries that start a thread pool at import (numpy's BLAS) would fail under RLIMIT_NPROC
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


# --- seccomp: refuse new processes, allow threads ---------------------------------------------------------
# classic BPF over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _KILL, _ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_CLONE_THREAD = 0x00010000
# machine: (AUDIT_ARCH, clone, clone3, fork/vfork..., x32 syscall bit or 0)
_SYSCALLS = {
    "x86_64": (0xC000003E, 56, 435, (57, 58), 0x40000000),
    "aarch64": (0xC00000B7, 220, 435, (), 0),
}


def _no_processes_filter() -> bytes | None:
    """A seccomp program (for bwrap's ``--seccomp``) that refuses ``fork``, ``vfork`` and ``clone`` without
    ``CLONE_THREAD`` with EPERM, and ``clone3`` with ENOSYS (the C library then falls back to ``clone``, so
    threads still start); another architecture's system calls kill the process. None on other machines."""
    known = _SYSCALLS.get(platform.machine())
    if known is None:
        return None
    arch, clone, clone3, forks, x32 = known
    # (code, jump-if-true label, jump-if-false label, k); labels are resolved below, None = next instruction
    program: list[tuple[int, str | None, str | None, int]] = [(_LD_ABS, None, None, 4),
                                                                (_JEQ, None, "kill", arch),
                                                                (_LD_ABS, None, None, 0)]
    if x32:
        program.append((_JGE, "kill", None, x32))
    program += [(_JEQ, "eperm", None, nr) for nr in forks]
    program += [(_JEQ, "enosys", None, clone3), (_JEQ, None, "allow", clone),
                (_LD_ABS, None, None, 16),  # args[0] (the flags), low 32 bits (little-endian)
                (_JSET, "allow", "eperm", _CLONE_THREAD)]
    labels = {"allow": (_RET, _ALLOW), "eperm": (_RET, _ERRNO | 1), "enosys": (_RET, _ERRNO | 38),
              "kill": (_RET, _KILL)}
    where = {name: len(program) + i for i, name in enumerate(labels)}
    out = []
    for i, (code, jt, jf, k) in enumerate(program):
        jump_t = where[jt] - i - 1 if jt else 0
        jump_f = where[jf] - i - 1 if jf else 0
        out.append(struct.pack("<HBBI", code, jump_t, jump_f, k))
    out += [struct.pack("<HBBI", code, 0, 0, k) for code, k in labels.values()]
    return b"".join(out)


# --- bubblewrap -------------------------------------------------------------------------------------------


def bwrap_executable() -> str | None:
    """The bubblewrap executable to use (``$GCORE_BWRAP``, else ``bwrap`` on ``PATH``), or None if missing."""
    return shutil.which(os.environ.get(BWRAP_ENV) or "bwrap")


def _missing_message() -> str:
    name = os.environ.get(BWRAP_ENV) or "bwrap"
    return (f"the python tool's sandbox needs bubblewrap, and {name!r} is not installed (not found on PATH"
            f"{'; set by ' + BWRAP_ENV if os.environ.get(BWRAP_ENV) else ''}): install it "
            f"(apt-get install bubblewrap), or pass {UNSAFE_OPTION} to run the tool's code without isolation "
            "(unsafe: the code can read and write what the trainer can)")


def _unusable_message(executable: str, reason: str) -> str:
    return (f"bubblewrap ({executable}) cannot make a sandbox here: {reason or 'it failed with no message'}; "
            "it needs bubblewrap 0.8 or later and unprivileged user namespaces (sysctl user.max_user_namespaces "
            "> 0, kernel.unprivileged_userns_clone=1 where it exists, kernel.apparmor_restrict_unprivileged_userns=0"
            f" on Ubuntu); or pass {UNSAFE_OPTION} to run the tool's code without isolation (unsafe)")


def _system_mounts() -> list[str]:
    """Read-only system paths Python needs: ``/usr``, the ``/lib*`` and ``bin`` links (or folders), the
    dynamic linker's files, and the running Python installation where it lies outside ``/usr``."""
    args: list[str] = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime"):
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    covered = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
    python_dirs = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                   os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    for path in sorted({os.path.realpath(p) for p in python_dirs} | python_dirs, key=len):
        if path and os.path.isdir(path) and not any(path == c or path.startswith(c.rstrip("/") + "/")
                                                    for c in covered):
            args += ["--ro-bind", path, path]
            covered.append(path)
    return args


def _bwrap_command(executable: str, limits: SandboxLimits, code_fd: int, info_fd: int,
                   seccomp_fd: int | None, python_args: list[str]) -> list[str]:
    scratch_bytes = str(max(1, limits.scratch_mb) * 2**20)
    mounts = _system_mounts()
    command = [
        executable,
        "--unshare-all", "--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534",
        "--hostname", "sandbox", "--die-with-parent", "--new-session",
        "--size", scratch_bytes, "--tmpfs", _INSIDE_SCRATCH,
        *mounts,
        # /tmp is the scratch too, unless a Python installation under /tmp (a CI's virtual environment) is there
        *([] if any(arg == "/tmp" or arg.startswith("/tmp/") for arg in mounts) else
          ["--symlink", _INSIDE_SCRATCH, "/tmp"]),
        "--proc", "/proc",
        "--dev", "/dev", "--size", scratch_bytes, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
        "--ro-bind-data", str(code_fd), _INSIDE_CODE,
        "--remount-ro", "/",
        "--chdir", _INSIDE_SCRATCH,
        "--clearenv",
    ]
    for key, value in _environment(_INSIDE_SCRATCH).items():
        command += ["--setenv", key, value]
    command += ["--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    return [*command, "--", *python_args]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)  # close-on-exec: another thread's sandbox must not inherit it (pass_fds passes it)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.lru_cache(maxsize=8)
def _probe(executable: str) -> str | None:
    """Why bubblewrap at ``executable`` cannot run a sandbox (one line), or None when it can; cached."""
    try:
        result = _run(executable, "print('ok')", SandboxLimits(wall_s=120))
    except SandboxUnavailable as err:
        return str(err)
    if result.error is not None or result.stdout != "ok\n":
        return _unusable_message(executable, f"a test run ended with {result.error or repr(result.stdout)}: "
                                 f"{_last_line(result.stderr)}")
    return None


def check_sandbox(sandbox: str = "bwrap") -> None:
    """Raise :class:`SandboxUnavailable` (one line: what to install or change) when ``sandbox`` cannot run here.

    ``"none"`` always can. ``"bwrap"`` needs the executable (``$GCORE_BWRAP`` or ``bwrap``) and a test run
    that works (user namespaces allowed); the test run is done once per executable and process.
    """
    if sandbox not in SANDBOXES:
        raise ValueError(f"sandbox {sandbox!r}: valid choices: {', '.join(SANDBOXES)}")
    if sandbox == "none":
        return
    executable = bwrap_executable()
    if executable is None:
        raise SandboxUnavailable(_missing_message())
    reason = _probe(executable)
    if reason is not None:
        raise SandboxUnavailable(reason)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), sandbox: str = "bwrap") -> SandboxResult:
    """Run ``code`` in a fresh, limited Python process; see the module docstring for what is limited and how.

    ``sandbox="bwrap"`` raises :class:`SandboxUnavailable` when bubblewrap is missing or cannot start (one line
    saying what to install); ``"none"`` runs it without isolation.
    """
    if sandbox not in SANDBOXES:
        raise ValueError(f"sandbox {sandbox!r}: valid choices: {', '.join(SANDBOXES)}")
    if sandbox == "none":
        return _run_unisolated(code, limits)
    executable = bwrap_executable()
    if executable is None:
        raise SandboxUnavailable(_missing_message())
    return _run(executable, code, limits)


def _config(limits: SandboxLimits, code_path: str, scratch: str, nproc: int | None) -> tuple[str, int]:
    cpu_limit = max(1, math.ceil(limits.cpu_s))
    return json.dumps({"cpu": cpu_limit, "memory": limits.memory_mb * 2**20, "fsize": limits.file_bytes,
                       "nproc": nproc, "code": code_path, "scratch": scratch}), cpu_limit


def _python_args(config: str) -> list[str]:
    return [sys.executable, "-I", "-B", "-u", "-X", "utf8", "-c", _BOOTSTRAP, config]


def _run(executable: str, code: str, limits: SandboxLimits) -> SandboxResult:
    """One run under bubblewrap."""
    seccomp = _no_processes_filter() if limits.processes == 0 else None
    if limits.processes is None or (limits.processes == 0 and seccomp is not None):
        nproc = None
    else:  # the sandbox's init and the code count as well
        nproc = limits.processes + 2
    config, cpu_limit = _config(limits, _INSIDE_CODE, _INSIDE_SCRATCH, nproc)
    fds: list[int] = []
    proc: subprocess.Popen[bytes] | None = None
    try:
        code_fd = _memfd("gcore-sandbox-code", code.encode("utf-8", errors="surrogateescape"))
        fds.append(code_fd)
        seccomp_fd = None
        if seccomp is not None:
            seccomp_fd = _memfd("gcore-sandbox-seccomp", seccomp)
            fds.append(seccomp_fd)
        info_read, info_write = os.pipe()
        fds += [info_read, info_write]
        command = _bwrap_command(executable, limits, code_fd, info_write, seccomp_fd, _python_args(config))
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={"PATH": _PATH},  # bwrap's own environment is visible inside as /proc/1/environ
                start_new_session=True,
                pass_fds=[fd for fd in fds if fd != info_read],
            )
        except OSError as err:
            raise SandboxUnavailable(_unusable_message(executable, str(err))) from None
        os.close(info_write)
        fds.remove(info_write)
        result = _supervise(proc, limits, cpu_limit, bwrap=True)
        os.set_blocking(info_read, False)
        try:
            started = bool(os.read(info_read, 4096))
        except BlockingIOError:
            started = False
        if not started and result.error is not None and not result.error.startswith("timed out"):
            # bwrap failed before the code ran (its own "bwrap: ..." line on stderr)
            raise SandboxUnavailable(_unusable_message(executable, _last_line(result.stderr)))
        return result
    finally:
        if proc is not None:
            _cleanup(proc)
        for fd in fds:
            os.close(fd)


def _run_unisolated(code: str, limits: SandboxLimits) -> SandboxResult:
    """One run as a plain subprocess (``sandbox="none"``): a scratch directory in the host's temporary folder."""
    root = tempfile.mkdtemp(prefix="gcore-sandbox-")
    scratch = os.path.join(root, "scratch")
    os.mkdir(scratch)
    code_path = os.path.join(root, "main.py")  # outside the scratch dir: the hook refuses writes to it
    with open(code_path, "w", encoding="utf-8") as f:
        f.write(code)
    config, cpu_limit = _config(limits, code_path, scratch, limits.processes)
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(
            _python_args(config),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=scratch,
            env=_environment(scratch),
            start_new_session=True,
        )
        return _supervise(proc, limits, cpu_limit, bwrap=False)
    finally:
        if proc is not None:
            _cleanup(proc)
        shutil.rmtree(root, ignore_errors=True)


def _cleanup(proc: subprocess.Popen[bytes]) -> None:
    if proc.returncode is None:  # _supervise did not get to its kill and reap (it raised)
        _kill_group(proc.pid)
        proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


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


def _supervise(proc: subprocess.Popen[bytes], limits: SandboxLimits, cpu_limit: int,
               bwrap: bool) -> SandboxResult:
    """Read the output with its cap until the code exits or a limit is hit; kill the group; reap; describe.

    With ``bwrap``, the process is bubblewrap: killing its group kills its PID namespace (``--die-with-parent``),
    and a code killed by signal N is its exit status 128 + N."""
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
        # (with bwrap the rest of the sandbox goes with it: --die-with-parent kills its PID namespace)
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
    returncode = proc.returncode
    if bwrap and 128 < returncode <= 128 + 64:  # bwrap's init passes a signal on as 128 + N
        returncode = 128 - returncode
    error = killed or _describe(returncode, cpu_used, stderr, limits, cpu_limit)
    return SandboxResult(stdout, stderr, error)
