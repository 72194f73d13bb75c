"""The programs the sandbox cases send to the ``python`` tool (the review's sb/ probes).

Each is a template: ``{MARKS!r}`` is the fixtures' marker folder (outside the sandbox: a file appearing there is
code that got past it), ``{OUTSIDE!r}`` a folder outside the sandbox holding ``secret.txt``, ``{CALLER}`` the pid
of the process that calls the tool (it holds the secret in its environment and command line). The programs
print what happened to each attempt; the verdict comes from the markers, the secret and the leftover processes,
not from what the program prints. ``fill`` substitutes the folders (``str.replace``, so other braces
stay); toolcall.py the pid.
"""

from __future__ import annotations

WRITE_OUTSIDE = r'''
import os, pathlib, shutil, tempfile
M = {MARKS!r}
def attempt(name, fn):
    try:
        fn()
        print(name, "wrote")
    except BaseException as e:
        print(name, "refused:", type(e).__name__, str(e)[:100])
def o(): open(os.path.join(M, "sb_open"), "w").write("x")
def osopen(): os.close(os.open(os.path.join(M, "sb_osopen"), os.O_WRONLY | os.O_CREAT))
def pl(): pathlib.Path(M, "sb_pathlib").write_text("x")
def cp():
    open("here.txt", "w").write("x"); shutil.copy("here.txt", os.path.join(M, "sb_copy"))
def ren():
    open("r.txt", "w").write("x"); os.rename("r.txt", os.path.join(M, "sb_rename"))
def rep():
    open("p.txt", "w").write("x"); os.replace("p.txt", os.path.join(M, "sb_replace"))
def lnk():
    open("l.txt", "w").write("x"); os.link("l.txt", os.path.join(M, "sb_link"))
def mk(): os.makedirs(os.path.join(M, "sb_makedirs", "a"))
def tmp(): tempfile.NamedTemporaryFile(dir=M, prefix="sb_tempfile", delete=False).write(b"x")
def chd():
    here = os.getcwd(); os.chdir(M)
    try:
        open("sb_chdir", "w").write("x")
    finally:
        os.chdir(here)
def sym():
    os.symlink(os.path.join(M, "sb_symlink"), "s"); open("s", "w").write("x")
for name, fn in [("open", o), ("os.open", osopen), ("pathlib", pl), ("shutil.copy", cp), ("os.rename", ren),
                 ("os.replace", rep), ("os.link", lnk), ("os.makedirs", mk), ("tempfile", tmp), ("chdir", chd),
                 ("symlink", sym)]:
    attempt(name, fn)
'''

DIRFD = r'''
import os
fd = os.open({MARKS!r}, os.O_RDONLY)
os.close(os.open("sb_dirfd", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
print("wrote")
'''

SQLITE = r'''
import os, sqlite3
db = sqlite3.connect(os.path.join({MARKS!r}, "sb_sqlite.db"))
db.execute("create table t (x)"); db.commit()
print("ok")
'''

HOOK_TAMPER = r'''
import gc, os
patched = 0
for obj in gc.get_objects():
    if callable(obj) and getattr(obj, "__name__", "") in ("_hook", "hook", "audit") and hasattr(obj, "__globals__"):
        for key, value in list(obj.__globals__.items()):
            if isinstance(value, (set, frozenset)) and any(isinstance(v, str) and "." in v for v in value):
                obj.__globals__[key] = frozenset(); patched += 1
            elif callable(value) and key.startswith("_") and key != "_hook" and hasattr(value, "__code__"):
                obj.__globals__[key] = lambda *a, **k: True; patched += 1
print("patched", patched)
print(os.system("touch " + os.path.join({MARKS!r}, "sb_hook_tamper")))
'''

CTYPES_SYSTEM = r'''
import ctypes, os
print(ctypes.CDLL(None).system(("touch " + os.path.join({MARKS!r}, "sb_ctypes_system")).encode()))
'''

SETSID = r'''
import ctypes, os
libc = ctypes.CDLL(None)
pid = libc.fork()
if pid == 0:
    libc.setsid()
    libc.system(("sleep 12; touch " + os.path.join({MARKS!r}, "sb_setsid_survivor")).encode())
    libc._exit(0)
print("parent", os.getpid(), "child", pid)
'''

CTYPES_KILL = r'''
import ctypes, os
libc = ctypes.CDLL(None)
print("kill(getppid, 0) =", libc.kill(os.getppid(), 0))
print("kill(caller, 0) =", libc.kill({CALLER}, 0))
'''

NETWORK = r'''
import socket, urllib.request
def attempt(name, fn):
    try:
        fn(); print(name, "allowed")
    except BaseException as e:
        print(name, "refused:", type(e).__name__, str(e)[:80])
def tcp():
    s = socket.socket(); s.settimeout(2); s.connect(("127.0.0.1", 9))
def unix():
    s = socket.socket(socket.AF_UNIX); s.connect("/run/systemd/private")
def listen():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
def udp():
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("127.0.0.1", 9))
def cc(): socket.create_connection(("127.0.0.1", 9), timeout=2)
def url(): urllib.request.urlopen("http://127.0.0.1:9/", timeout=2)
for name, fn in [("tcp", tcp), ("unix", unix), ("bind+listen", listen), ("udp", udp), ("create_connection", cc),
                 ("urllib", url)]:
    attempt(name, fn)
'''

PROCESSES = r'''
import os, subprocess, time, multiprocessing
M = {MARKS!r}
def attempt(name, fn):
    try:
        fn(); print(name, "allowed")
    except BaseException as e:
        print(name, "refused:", type(e).__name__, str(e)[:80])
def sp(): subprocess.run(["touch", os.path.join(M, "sb_subprocess")])
def sy(): os.system("touch " + os.path.join(M, "sb_os_system"))
def po(): os.popen("touch " + os.path.join(M, "sb_popen")).read()
def fk():
    pid = os.fork()
    if pid == 0:
        open(os.path.join(M, "sb_fork"), "w").close(); os._exit(0)
    os.waitpid(pid, 0)
def bomb():
    for _ in range(40):  # bounded: 40 children that sleep; the sandbox must end them all
        if os.fork() == 0:
            time.sleep(120); os._exit(0)
def mp():
    p = multiprocessing.Process(target=os.system, args=("touch " + os.path.join(M, "sb_multiprocessing"),))
    p.start(); p.join()
for name, fn in [("subprocess.run", sp), ("os.system", sy), ("os.popen", po), ("os.fork", fk), ("fork x40", bomb),
                 ("multiprocessing", mp)]:
    attempt(name, fn)
'''

THREADS = r'''
import threading
t = threading.Thread(target=lambda: print("thread ran")); t.start(); t.join()
'''

MEMORY = r'''
import mmap
def attempt(name, fn):
    try:
        fn(); print(name, "allowed")
    except BaseException as e:
        print(name, "refused:", type(e).__name__, str(e)[:80])
attempt("bytearray 10 GiB", lambda: bytearray(10 * 2**30))
attempt("mmap 600 MB", lambda: mmap.mmap(-1, 600 * 2**20))
attempt("bytearray 400 MB", lambda: bytearray(400 * 2**20))
'''

BUSY = "while True:\n    pass\n"
SLEEP = "import time\ntime.sleep(1000)\n"
PRINT = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 2**20)\n"
BIG_FILE = "open('big', 'wb').write(b'x' * 100 * 2**20)\nprint('wrote 100 MB')\n"
MANY_FILES = "for i in range(40):\n    open(f'f{i}', 'wb').write(b'x' * 15 * 2**20)\nprint('wrote 40 x 15 MB')\n"

OS_KILL = r'''
import os, signal, threading
def attempt(name, fn):
    try:
        fn(); print(name, "allowed")
    except BaseException as e:
        print(name, "refused:", type(e).__name__, str(e)[:80])
attempt("os.kill(caller, 0)", lambda: os.kill({CALLER}, 0))
attempt("pthread_kill", lambda: signal.pthread_kill(threading.main_thread().ident, 0))
attempt("os.kill(getppid(), SIGKILL)", lambda: os.kill(os.getppid(), signal.SIGKILL))
'''

READ_OUTSIDE = r'''
import os
def attempt(name, fn):
    try:
        print(name, "read:", repr(fn())[:200])
    except BaseException as e:
        print(name, "refused:", type(e).__name__, str(e)[:80])
attempt("/etc/passwd", lambda: open("/etc/passwd").read(60))
attempt("secret.txt", lambda: open(os.path.join({OUTSIDE!r}, "secret.txt")).read())
attempt("listdir /", lambda: sorted(os.listdir("/"))[:8])
attempt("listdir outside", lambda: os.listdir({OUTSIDE!r}))
'''

ENVIRON = "import os\nprint(sorted(os.environ.items()))\n"

PROC_PARENT = r'''
import os
def attempt(name, path):
    try:
        data = open(path, "rb").read()
        print(name, "READ", len(data), "bytes:", data[:3000])
    except BaseException as e:
        print(name, "refused:", type(e).__name__, str(e)[:80])
# the caller (the trainer, by its pid outside) is what must stay unreadable; the code's parent may be the sandbox's
# own init (bwrap's pid 1 in its PID namespace), whose memory and clean environment are not the trainer's
for who, pid in (("parent", os.getppid()), ("caller", {CALLER})):
    for part in ("environ", "cmdline", "maps"):
        attempt(f"{who} /proc/{pid}/{part}", f"/proc/{pid}/{part}")
attempt("/proc/1/environ", "/proc/1/environ")
'''

CTYPES_IMPORT = "import ctypes\nprint('ctypes ok')\n"
SYS_EXIT = "import sys\nsys.exit(0)\n"
OS_EXIT = "import os\nos._exit(3)\n"


def fill(template: str, marks: str, outside: str) -> str:
    """The program with the marker and outside folders filled in (``{CALLER}`` is left to toolcall.py)."""
    return template.replace("{MARKS!r}", repr(marks)).replace("{OUTSIDE!r}", repr(outside))
