"""The cases of the reliability review (2026-11-28), one entry per row of its tables.

A case is run by ``run.py`` in one of these ways (``Case.kind``):

- ``fit``: ``gcore fit`` with the case's options after :data:`SMALL` (the embedded tiny model, 2 steps), as a CLI
  run in a session of its own; ``env`` adds variables (``PYTHONPATH`` gets the fixtures folder first, so
  ``--env badenvs.X`` imports the fixtures' environments);
- ``tool``: the case's programs (:mod:`sandbox_programs`) through the ``python`` tool's public call
  (:mod:`toolcall`), judged by markers, the caller's secret and leftover processes;
- ``probe``: a function of :mod:`probes` that starts a run and acts on it (connects to a worker's port, kills a
  worker, watches ``/dev/shm``);
- ``manual``: a row that needs a prepared checkpoint, a second user or a bind mount; listed, not run (its
  ``note`` says what it needs).

How a finished case is judged (``run.py``'s ``judge``, in this order): a marker written, the secret printed, a
process left behind, or ``unsafe_if`` matching the output -> **unsafe**; killed at the timeout or the memory cap
with no exit -> **hang**; a Python traceback in the output -> **crash**; ``ok_if`` matching (with the exit status
in ``ok_rc``) -> **ok**; exit status 2 and a ``gcore: error:`` line that contains ``keyword`` -> **clear** (with
another line or without the keyword: **unclear**); exit status 0 otherwise -> **silent**; anything else ->
**unclear**. ``review`` is what the review found on main at aed9ad4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sandbox_programs as sb

SMALL = ["--trainer.enable_progress_bar", "false", "--trainer.max_steps", "2", "--data.prompts_per_step", "2",
         "--sampling.n", "2", "--sampling.max_new_tokens", "8"]


@dataclass
class Case:
    id: str
    section: str  # sandbox, env, pool, images, open, old, async, controllers
    title: str
    review: str  # the review's result on aed9ad4
    kind: str = "fit"  # fit, tool, probe, manual
    args: list[str] = field(default_factory=list)  # fit: options ({fx} is the fixtures folder)
    env: dict[str, str] = field(default_factory=dict)
    programs: list[str] = field(default_factory=list)  # tool: program templates
    probe: str = ""  # probe: the function's name in probes.py
    keyword: str = ""  # what a clear error names
    ok_if: str = ""  # regex on stdout+stderr that makes the case ok
    ok_rc: tuple[int, ...] = (0,)
    unsafe_if: str = ""  # regex on the output that makes the case unsafe
    timeout_s: float = 900.0
    settle_s: float = 2.0  # tool: wait this long after the call for a process that escaped to act
    base: bool = False  # fit/export: runs on a copy of the base run (BASE: saves after steps 1, 3, 5)
    tamper: str = ""  # fixtures.tamper's ``how``, applied to the copy's newest checkpoint
    command: str = "fit"  # fit or export (``{ckpt}``: the newest checkpoint of the copy, ``{root}``: the case's folder)
    stdin: str = ""  # text written to the command's stdin (empty: /dev/null)
    note: str = ""


def _fit(id: str, section: str, title: str, review: str, args: list[str], **kw) -> Case:
    return Case(id, section, title, review, "fit", args, **kw)


def _tool(id: str, title: str, review: str, *programs: str, **kw) -> Case:
    return Case(id, "sandbox", title, review, "tool", programs=list(programs), timeout_s=kw.pop("timeout_s", 300),
                **kw)


REWARD = ["--reward", "python", "--data.path", "{fx}/good.jsonl", "--reward.function"]
ENV = ["--data.path", "{fx}/good.jsonl", "--env"]
IMG = ["--data.image_key", "image", "--data.prompts_per_step", "4", "--data.path"]
BASE = ["--data.path", "{fx}/good.jsonl", "--trainer.max_steps", "6", "--trainer.checkpoint_every", "2"]
RESUME = ["--data.path", "{fx}/good.jsonl", "--trainer.max_steps", "8", "--trainer.checkpoint_every", "2",
          "--trainer.resume", "auto"]
EXPORT = ["{ckpt}", "--to", "hf", "{root}/exported"]

CASES: list[Case] = [
    # --- 1. the cases left open on 2026-11-25 -------------------------------------------------------------
    Case("open.export_custom", "open", "gcore export of a checkpoint whose hf/config.json names custom code "
         "(auto_map -> hf/evil_config.py), stdin /dev/null", "clear, no code ran", "fit", EXPORT,
         keyword="custom code", base=True, tamper="hf_custom", command="export"),
    Case("open.export_custom_yes", "open", "same, stdin 'y' (the user would answer yes)", "clear, no code ran",
         "fit", EXPORT, keyword="custom code", base=True, tamper="hf_custom", command="export", stdin="y\ny\n"),
    Case("open.two_runs", "open", "two runs in one run folder (B started once A logged a step)", "clear", "manual",
         note="two concurrent 40-step CLI runs (23 min under load in the review)"),
    _fit("open.reward_sysexit", "open", "reward calls sys.exit(0)", "clear",
         [*REWARD, "{fx}/rewards.py:sysexit"], keyword="SystemExit"),
    _fit("open.reward_hang", "open", "reward never returns (time.sleep in a loop)", "clear",
         [*REWARD, "{fx}/rewards.py:hang"], keyword="did not return"),
    _fit("open.reward_busy", "open", "reward in a pure-Python endless loop", "clear",
         [*REWARD, "{fx}/rewards.py:busy"], keyword="did not return"),
    _fit("open.fifo", "open", "--data.path a named pipe with no writer", "clear",
         ["--data.path", "{fx}/fifo.jsonl"], keyword="named pipe"),
    _fit("open.reward_bigint", "open", "reward 10**400", "clear", [*REWARD, "{fx}/rewards.py:bigint"],
         keyword="digits"),
    _fit("open.reward_huge", "open", "reward 2e300", "clear", [*REWARD, "{fx}/rewards.py:huge"], keyword="2e+300"),
    Case("open.other_user", "open", "resumed run folder of another user (gcore/ owned by root, run as uid 65534)",
         "clear", "manual", note="needs root, a prepared run folder and a setuid child"),
    _fit("open.master_port_lo", "open", "MASTER_PORT in use on 127.0.0.1, --trainer.devices 2", "clear",
         ["--trainer.devices", "2", "--trainer.accelerator", "cpu"], env={"MASTER_PORT": "@listen:127.0.0.1"},
         keyword="already in use"),
    _fit("open.master_port_any", "open", "MASTER_PORT in use on 0.0.0.0, --trainer.devices 2", "clear",
         ["--trainer.devices", "2", "--trainer.accelerator", "cpu"], env={"MASTER_PORT": "@listen:0.0.0.0"},
         keyword="already in use"),
    _fit("open.model_custom", "open", "--model.path with an unknown model_type + auto_map -> evil.py", "clear",
         ["--model.path", "{fx}/models/remote_custom"], keyword="custom code"),
    _fit("open.model_pickle", "open", "--model.path with only a pytorch_model.bin pickle payload", "clear",
         ["--model.path", "{fx}/models/pklbin"], keyword="pytorch_model.bin"),
    Case("open.ro_checkpoints", "open", "checkpoints/ read-only (bind mount), resume auto", "clear", "manual",
         note="needs a read-only bind mount (root) over a run's checkpoints/"),
    _fit("open.futurewarning", "open", "a good run with a save: no FutureWarning on stderr", "ok",
         ["--data.path", "{fx}/good.jsonl", "--trainer.checkpoint_every", "1"],
         ok_if=r"\A(?![\s\S]*Warning)", unsafe_if=""),
    # --- 2. a sample of the older cases -----------------------------------------------------------------
    _fit("old.model_missing", "old", "--model.path to no folder", "clear", ["--model.path", "{fx}/nonexistent"],
         keyword="not a directory"),
    _fit("old.malformed", "old", "--data.path malformed.jsonl (bad line 16)", "clear",
         ["--data.path", "{fx}/malformed.jsonl"], keyword="malformed.jsonl:16"),
    _fit("old.reward_nan", "old", "reward always NaN", "clear", [*REWARD, "{fx}/rewards.py:nan"], keyword="nan"),
    _fit("old.algorithm", "old", "--algorithm foo", "clear", ["--algorithm", "foo"], keyword="valid choices"),
    Case("old.ctrl_c_save", "old", "Ctrl-C as a checkpoint is being written", "ok", "manual",
         note="a signal timed on step_*.tmp appearing (the review's harness.py)"),
    _fit("old.truncated_ckpt", "old", "resume, newest checkpoint's __0_0.distcp truncated to 1 MB", "ok", RESUME,
         base=True, tamper="truncate", ok_if=r"truncated or corrupted[\s\S]*resumed from"),
    _fit("old.rank0_payload", "old", "resume, __reduce__ payload in rank_0.pt (manifest recomputed)", "clear",
         RESUME, base=True, tamper="rank0", keyword="rank_0.pt"),
    _fit("old.metadata_payload", "old", "resume, .metadata replaced by a payload pickle (manifest recomputed)",
         "clear", RESUME, base=True, tamper="metadata", keyword=".metadata"),
    # --- 3a. environments -------------------------------------------------------------------------------
    _fit("env.raises", "env", "step raises RuntimeError", "ok", [*ENV, "badenvs.Raises"],
         ok_if=r"environment error[\s\S]*Raises\.step raised RuntimeError"),
    _fit("env.exits", "env", "step calls sys.exit(0)", "ok", [*ENV, "badenvs.Exits"], ok_if=r"Exits\.step"),
    _fit("env.returns_dict", "env", "step returns a dict", "clear", [*ENV, "badenvs.ReturnsDict"],
         keyword="ReturnsDict"),
    _fit("env.bad_obs", "env", "observation an int", "clear", [*ENV, "badenvs.BadObs"], keyword="BadObs"),
    _fit("env.bad_ids", "env", "observation token ids out of the vocabulary ([10**9, -5])", "crash",
         [*ENV, "badenvs.BadIds"], keyword="BadIds"),
    _fit("env.nan_reward", "env", "turn reward NaN", "crash", [*ENV, "badenvs.NanReward"], keyword="NanReward"),
    _fit("env.never_ends", "env", "never ends (cut at --env.max_turns)", "ok", [*ENV, "badenvs.NeverEnds"],
         ok_if=r"\A"),
    _fit("env.huge_obs", "env", "5,000,000-character observation each turn", "hang",
         [*ENV, "badenvs.Huge"], keyword="Huge", ok_if=r"Huge[\s\S]*(limit|too long|characters|tokens)",
         timeout_s=900),
    _fit("env.hangs", "env", "step sleeps for ever, --env.timeout_s 10: the run must also exit", "hang (at exit)",
         [*ENV, "badenvs.Hangs", "--env.timeout_s", "10"], ok_if=r"Hangs\.step did not return", timeout_s=900),
    _fit("env.tools_embedded", "env", "--env tools --env.tools [python, calculator] on the embedded model", "clear",
         ["--data.path", "{fx}/good.jsonl", "--env", "tools", "--env.tools", "[python, calculator]"],
         keyword="chat template"),
    # --- 3a. the python tool's sandbox ------------------------------------------------------------------
    _tool("sb.write_outside", "write outside the scratch dir, 11 ways", "ok: blocked", sb.WRITE_OUTSIDE),
    _tool("sb.dirfd", "os.open(..., dir_fd=<outside folder>)", "unsafe", sb.DIRFD),
    _tool("sb.sqlite", "sqlite3.connect(<outside path>)", "unsafe", sb.SQLITE),
    _tool("sb.hook_tamper", "switch the audit hook off through gc.get_objects(), then os.system", "unsafe",
          sb.HOOK_TAMPER),
    _tool("sb.ctypes_system", "ctypes system()", "unsafe", sb.CTYPES_SYSTEM),
    _tool("sb.setsid_survivor", "ctypes fork() + setsid() child that outlives the kill", "unsafe", sb.SETSID,
          settle_s=20.0),
    _tool("sb.ctypes_kill", "ctypes kill(<caller>, 0)", "unsafe", sb.CTYPES_KILL,
          unsafe_if=r"kill\(caller, 0\) = 0"),
    _tool("sb.network", "network: TCP, UNIX, bind+listen, UDP, create_connection, urllib", "ok: blocked",
          sb.NETWORK, unsafe_if=r"(tcp|unix|bind\+listen|udp|create_connection|urllib) allowed"),
    _tool("sb.processes", "processes: subprocess, os.system, popen, fork, 40 forks, multiprocessing",
          "ok: blocked", sb.PROCESSES),
    _tool("sb.threads", "threads", "ok: allowed", sb.THREADS, ok_if=r"."),
    _tool("sb.memory", "bytearray(10 GiB) / mmap 600 MB / bytearray(400 MB)", "ok",
          sb.MEMORY, ok_if=r"bytearray 10 GiB refused"),
    _tool("sb.loops", "while True: pass / time.sleep(1000)", "ok: blocked", sb.BUSY, sb.SLEEP,
          ok_if=r"(?s)(timed out|timeout|CPU limit).*(timed out|timeout|CPU limit)"),  # either limit stops it
    _tool("sb.print", "print 100 MB", "ok: blocked", sb.PRINT, ok_if=r"output over"),
    _tool("sb.files", "one 100 MB file / 40 files of 15 MB", "ok: blocked", sb.BIG_FILE, sb.MANY_FILES,
          ok_if=r"(?s)(File too large|Errno 27|file size|limit).*(timed out|File too large|Errno 27|limit)"),
    _tool("sb.os_kill", "os.kill(<caller>), signal.pthread_kill, os.kill(getppid(), SIGKILL)", "ok: blocked",
          sb.OS_KILL, unsafe_if=r"os\.kill\(caller, 0\) allowed"),
    _tool("sb.read_outside", "read /etc/passwd, a file outside, listdir('/')", "ok (by design)", sb.READ_OUTSIDE,
          ok_if=r"."),
    _tool("sb.environ", "os.environ", "ok: clean", sb.ENVIRON, ok_if=r"."),
    _tool("sb.proc_parent", "/proc/<parent>/environ, cmdline, maps", "unsafe", sb.PROC_PARENT,
          unsafe_if=r"caller /proc/\d+/\w+ READ [1-9]"),
    _tool("sb.ctypes_import", "import ctypes", "ok: allowed (documented)", sb.CTYPES_IMPORT, ok_if=r"."),
    _tool("sb.exit", "sys.exit(0) / os._exit(3)", "ok", sb.SYS_EXIT, sb.OS_EXIT, ok_if=r"."),
    # --- 3b. image prompts --------------------------------------------------------------------------------
    _fit("img.good", "images", "a good 56x56 PNG", "ok", [*IMG, "{fx}/img_good.jsonl"], ok_if=r"\A"),
    _fit("img.missing", "images", "missing file", "clear", [*IMG, "{fx}/img_missing.jsonl"], keyword="no such file"),
    _fit("img.corrupt", "images", "corrupt PNG (header kept, body random)", "clear",
         [*IMG, "{fx}/img_corrupt.jsonl"], keyword="corrupt.png"),
    _fit("img.notimage", "images", "a text file named .png", "clear", [*IMG, "{fx}/img_notimage.jsonl"],
         keyword="notimage.png"),
    _fit("img.big", "images", "6000x6000 (36 Mpx, over --data.max_image_pixels)", "clear",
         [*IMG, "{fx}/img_big.jsonl"], keyword="max_image_pixels"),
    _fit("img.bomb", "images", "20000x20000 1-bit PNG (400 Mpx, 48 kB)", "crash", [*IMG, "{fx}/img_bomb.jsonl"],
         keyword="bomb400m.png"),
    _fit("img.bomb_resize", "images", "same with --data.resize_images true", "crash",
         [*IMG, "{fx}/img_bomb.jsonl", "--data.resize_images", "true"], keyword="bomb400m.png", ok_if=r"\A"),
    _fit("img.passwd", "images", "../../../../../../etc/passwd", "clear", [*IMG, "{fx}/img_passwd.jsonl"],
         keyword="passwd"),
    _fit("img.abs", "images", "absolute /etc/hostname", "clear", [*IMG, "{fx}/img_abs.jsonl"], keyword="hostname"),
    _fit("img.url", "images", "http://127.0.0.1:9/x.png", "clear", [*IMG, "{fx}/img_url.jsonl"], keyword="x.png"),
    # --- 3c. async training with partial rollouts ---------------------------------------------------------
    Case("async.reference", "async", "uninterrupted reference, --placement dynamic --trainer.max_staleness 2 "
         "--trainer.partial_rollouts true", "ok", "manual", note="a 6-step async CLI run (3 min in the review)"),
    Case("async.sigterm", "async", "SIGTERM while step_00000003.tmp is written", "ok", "manual",
         note="a signal timed on a checkpoint's .tmp folder"),
    Case("async.resume", "async", "--trainer.resume auto after the SIGTERM", "ok (not exact, announced)", "manual",
         note="follows async.sigterm"),
    # --- 3d. engine worker pool -------------------------------------------------------------------------
    Case("pool.addresses", "pool", "every listening socket of a run with --placement.workers 2 on 127.0.0.1",
         "ok: loopback only", "probe", probe="addresses_and_weights", timeout_s=900),
    Case("pool.weights_mode", "pool", "policy weights in /dev/shm readable by other users", "unsafe", "probe",
         probe="addresses_and_weights", timeout_s=900),
    Case("pool.silent_client", "pool", "a local process connects to a worker's port before the controller and "
         "stays silent; another worker is killed", "hang", "probe", probe="silent_client", timeout_s=1200,
         # ok: the stranger dropped and the killed worker reported, the run to its end
         ok_if=r"(?s)(?=.*dropped a connection)(?=.*(stopped answering|was killed|respawning))"),
    Case("pool.garbage_client", "pool", "a local client sends garbage to a worker's port", "(worker ends; the "
         "review's listener_demo only)", "probe", probe="garbage_client", timeout_s=1200,
         ok_if=r"dropped a connection from \S+: it failed authentication"),  # and the run goes on to its end
    Case("pool.kill_running", "pool", "SIGKILL one of 2 engine workers once steps are logged", "ok: recovered",
         "probe", probe="kill_running", timeout_s=1200, ok_if=r"respawning engine workers"),
    Case("pool.kill_loading", "pool", "SIGKILL an engine worker while it loads", "clear", "probe",
         probe="kill_loading", timeout_s=900),
    # --- 3e. two controllers ----------------------------------------------------------------------------
    Case("controllers.kill", "controllers", "SIGKILL controller 1 mid-step", "clear", "manual",
         note="an 8-step 2-controller CLI run, a kill timed on the metrics"),
    Case("controllers.resume", "controllers", "checkpoints intact after the kill; resume auto", "ok", "manual",
         note="follows controllers.kill"),
]


def by_section(sections: list[str] | None) -> list[Case]:
    """The cases of these sections, ids or id prefixes, in the order named (``None``: all, in table order)."""
    if not sections:
        return list(CASES)

    def rank(case: Case) -> int | None:
        for i, s in enumerate(sections):
            if case.section == s or case.id.startswith(s):
                return i
        return None

    chosen = [(rank(c), n, c) for n, c in enumerate(CASES) if rank(c) is not None]
    return [c for _, _, c in sorted(chosen, key=lambda t: (t[0], t[1]))]
