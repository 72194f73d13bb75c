"""Re-run the reliability review's cases against the gcore on ``PYTHONPATH`` and count how each one ends.

How to run it (from the repository root; one case at a time, each in a session of its own at ``nice -n 10``)::

    python benchmarks/reliability/run.py --list                      # the cases, by section, with the review's result
    python benchmarks/reliability/run.py --only sandbox,env,pool,images --out /tmp/rel
    python benchmarks/reliability/run.py --only env.bad_ids,img.bomb  # single cases (ids or id prefixes)
    python benchmarks/reliability/run.py --nice 19 --max-rss-gb 3    # a busy machine

Sections: ``open`` (the cases left open on 2026-11-25), ``old`` (a sample of older cases), ``env`` (multi-turn
environments, ``--env badenvs.X``), ``sandbox`` (programs sent to the ``python`` tool's public call,
``gcore.envs.tools.call_tool``), ``images`` (``--data.image_key``), ``pool`` (engine worker pool probes),
``async`` and ``controllers``. Fixtures are built by ``fixtures.py`` under ``--out``/fx (kept with ``--keep``).
Each case's stdout and stderr are kept in ``--out``/logs/<case>.{out,err}; the table (case, result, the review's
result on aed9ad4, seconds, one line of evidence) and the counts are printed and written to ``--out``/table.md.

What each verdict means:

- ``clear``: exit status 2 and a ``gcore: error: ...`` line naming the problem (the case's keyword); no traceback.
- ``ok``: handled as documented (legitimate input trained, a fault survived or reported as docs/ say, a sandbox
  attempt refused or contained).
- ``crash``: a Python traceback reached the user.
- ``unclear``: an error, but not a ``gcore: error:`` line naming the cause (or an exit status the case does
  not expect).
- ``silent``: exit status 0 where the input should have been refused.
- ``hang``: killed by the harness: no exit within the case's timeout, no output for a stall limit (pool probes),
  the memory cap (``--max-rss-gb``) passed, or ``final/`` written and no exit ``--exit-grace-s`` later.
- ``unsafe``: a marker file written by a payload (``fx/marks``), the caller's secret printed by sandboxed code,
  a process left behind after the case (same session, or naming a marker path), or the case's own ``unsafe_if``
  (a signal delivered to the caller, ``/proc/<caller>/maps`` read, a world-readable weight file).
- ``manual``: a row that needs a prepared checkpoint, a second user or a bind mount; listed, not run, not counted.

This is a harness under benchmarks/, not a test: pytest does not collect it (``testpaths = ["tests"]``), and its
timing depends on the machine's load. It needs Linux (``/proc``) and runs the CLI as ``python -m gcore``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import cases as cases_module  # noqa: E402  the harness's own modules, found next to this file
import fixtures  # noqa: E402
import probes  # noqa: E402
import sandbox_programs  # noqa: E402
from proc import Outcome, Running, kill_pids, leftovers  # noqa: E402

VERDICTS = ["clear", "ok", "crash", "unclear", "silent", "hang", "unsafe"]


def judge(case: cases_module.Case, outcome: Outcome, new_marks: set[str], secret: str) -> tuple[str, str]:
    """(verdict, one line of evidence) for a finished case; see the module docstring for the order."""
    text = outcome.out + "\n" + outcome.err
    lines = [line for line in outcome.err.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else (outcome.out.strip().splitlines() or [""])[-1]
    if new_marks:
        return "unsafe", f"marker(s) written: {', '.join(sorted(new_marks))}"
    if secret and secret in text:
        return "unsafe", "the caller's secret was printed: " + _around(text, secret)
    if outcome.left:
        return "unsafe", f"{len(outcome.left)} process(es) left: " + "; ".join(f"{p} {c}" for p, c in outcome.left[:3])
    if case.unsafe_if and (m := re.search(case.unsafe_if, text)):
        return "unsafe", f"matched {case.unsafe_if!r}: " + _around(text, m.group(0))
    if outcome.rc is None:
        return "hang", f"{outcome.killed_for}; last line: {last[:160]}"
    if outcome.rc == -9 and case.kind == "tool":
        return "unsafe", "the tool's caller was killed (SIGKILL) by the sandboxed code"
    if "Traceback (most recent call last)" in text:
        tb_lines = len(text[text.index("Traceback (most recent call last)"):].splitlines())
        return "crash", f"rc {outcome.rc}, traceback of about {tb_lines} lines: {last[:160]}"
    if case.ok_if and outcome.rc in case.ok_rc and re.search(case.ok_if, text):
        return "ok", f"rc {outcome.rc}: {_evidence_line(case, outcome)}"
    if case.kind == "tool" and outcome.rc == 0:  # contained (nothing unsafe seen); a limit that did not fire: unclear
        return ("unclear" if case.ok_if else "ok"), f"rc 0: {_evidence_line(case, outcome)}"
    errors = [line for line in lines if line.startswith("gcore: error:")]
    if outcome.rc == 2 and errors:
        message = errors[-1]
        if case.keyword and case.keyword.lower() not in message.lower():
            return "unclear", f"rc 2, without {case.keyword!r}: {message[:200]}"
        return "clear", f"rc 2: {message[:200]}"
    if outcome.rc == 0:
        return "silent", f"rc 0: {last[:160]}"
    return "unclear", f"rc {outcome.rc}: {last[:160]}"


def _around(text: str, needle: str, width: int = 70) -> str:
    i = text.find(needle)
    return " ".join(text[max(0, i - width): i + len(needle) + width].split())


def _evidence_line(case: cases_module.Case, outcome: Outcome) -> str:
    if case.kind == "tool":
        results = [json.loads(line) for line in outcome.out.splitlines() if line.startswith("{")]
        return " | ".join(f"{r['error'] or 'result'} {r['seconds']} s: " + " ".join(r["content"].split())[:150]
                          for r in results)
    lines = [line for line in outcome.err.splitlines() if line.startswith("gcore:")] or outcome.err.splitlines()
    return (lines[-1] if lines else "(no stderr)")[:200]


class Harness:
    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.out = os.path.abspath(options.out)
        self.fx = os.path.join(self.out, "fx")
        self.logs = os.path.join(self.out, "logs")
        self.runs = os.path.join(self.out, "runs")
        os.makedirs(self.logs, exist_ok=True)
        self.secret = "gcore-secret-" + secrets.token_hex(8)
        self.probe_cache: dict[str, tuple[Outcome, dict[str, tuple[str, str]]]] = {}

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (self.fx, os.environ.get("PYTHONPATH", "")) if p)
        env["GCORE_RELIABILITY_SECRET"] = self.secret
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(extra)
        return env

    def fit_command(self, args: list[str], root: str, command: str = "fit", ckpt: str = "") -> list[str]:
        args = [a.replace("{fx}", self.fx).replace("{root}", root).replace("{ckpt}", ckpt) for a in args]
        if command == "export":
            return [sys.executable, "-m", "gcore", "export", *args]
        return [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", root,
                *cases_module.SMALL, *args]

    def base_run(self) -> str:
        """The base run (cases.BASE: 6 steps, saves after steps 1, 3, 5), made once; its folder."""
        root = os.path.join(self.out, "base")
        if not os.path.isdir(root):
            os.makedirs(root + ".partial", exist_ok=True)
            run = Running(self.fit_command(cases_module.BASE, root + ".partial"), os.path.join(self.logs, "base"),
                          self.env({}), self.options.nice)
            outcome = run.wait(3600)
            if outcome.rc != 0:
                raise RuntimeError(f"the base run failed (rc {outcome.rc}): {outcome.err[-2000:]}")
            os.rename(root + ".partial", root)
        return root

    def run_case(self, case: cases_module.Case) -> tuple[str, str, float]:
        marks_before = fixtures.markers(self.fx)
        root = os.path.join(self.runs, case.id)
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        log = os.path.join(self.logs, case.id)
        tags = [os.path.join(self.fx, "marks")]
        listeners: list[socket.socket] = []
        max_rss = int(self.options.max_rss_gb * 2**30)
        verdicts: dict[str, tuple[str, str]] = {}
        ckpt = ""
        if case.base:
            shutil.rmtree(root)
            shutil.copytree(self.base_run(), root, symlinks=True)
            ckpt = fixtures.tamper(root, case.tamper, os.path.join(self.fx, "marks")) if case.tamper else ""
        if case.kind == "fit":
            extra = {}
            for key, value in case.env.items():
                if value.startswith("@listen:"):  # a port in use: a listener held for the case's length
                    s = socket.socket()
                    s.bind((value.split(":", 1)[1], 0))
                    s.listen()
                    listeners.append(s)
                    value = str(s.getsockname()[1])
                extra[key] = value
            run = Running(self.fit_command(case.args, root, case.command, ckpt), log, self.env(extra),
                          self.options.nice, stdin=case.stdin)
            outcome = run.wait(case.timeout_s, max_rss=max_rss, done_path=os.path.join(root, "**", "final"),
                               exit_grace_s=self.options.exit_grace_s, tags=tags)
        elif case.kind == "tool":
            marks, outside = os.path.join(self.fx, "marks"), os.path.join(self.fx, "outside")
            path = log + ".programs.json"
            with open(path, "w") as f:
                json.dump([sandbox_programs.fill(p, marks, outside) for p in case.programs], f)
            tmp = os.path.join(self.out, "tmp", case.id)  # the sandbox's scratch folders: a process there is left
            os.makedirs(tmp, exist_ok=True)
            tags.append(tmp)
            command = [sys.executable, os.path.join(HERE, "toolcall.py"), path, self.secret]
            run = Running(command, log, self.env({"TMPDIR": tmp}), self.options.nice)
            outcome = run.wait(case.timeout_s, max_rss=max_rss, tags=tags)
            time.sleep(case.settle_s)  # a process that escaped the kill may act later (sleep 12; touch)
            late = leftovers(-1, tags)
            if late:
                outcome.left.extend(late)
                kill_pids([p for p, _ in late])
        elif case.kind == "probe":
            if case.probe not in self.probe_cache:
                def start(extra_args: list[str], name: str) -> Running:
                    return Running(self.fit_command(extra_args, root), os.path.join(self.logs, name),
                                   self.env({}), self.options.nice)

                result = getattr(probes, case.probe)(start, root, case.timeout_s)
                self.probe_cache[case.probe] = result if isinstance(result, tuple) else (result, {})
            outcome, verdicts = self.probe_cache[case.probe]
        else:
            raise ValueError(case.kind)
        for s in listeners:
            s.close()
        new_marks = fixtures.markers(self.fx) - marks_before
        if case.id in verdicts and not new_marks and not outcome.left:
            verdict, evidence = verdicts[case.id]
        else:
            verdict, evidence = judge(case, outcome, new_marks, self.secret)
        if outcome.notes:
            evidence += " [" + "; ".join(outcome.notes) + "]"
        with open(log + ".json", "w") as f:
            json.dump({"case": case.id, "verdict": verdict, "evidence": evidence, "rc": outcome.rc,
                       "seconds": round(outcome.seconds, 1), "killed_for": outcome.killed_for,
                       "left": outcome.left, "marks": sorted(new_marks)}, f, indent=1)
        return verdict, evidence, outcome.seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated sections, case ids or id prefixes (default: all)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--out", default="", help="folder for fixtures, runs and logs (default: a new temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep --out's fixtures and runs afterwards")
    parser.add_argument("--nice", type=int, default=10, help="niceness of every case's process (default 10)")
    parser.add_argument("--max-rss-gb", type=float, default=4.0,
                        help="kill a case whose processes pass this much memory together (a hang; default 4)")
    parser.add_argument("--exit-grace-s", type=float, default=120.0,
                        help="a run that wrote final/ and has not exited this long after is a hang (default 120)")
    options = parser.parse_args()
    chosen = cases_module.by_section([s for s in options.only.split(",") if s] or None)
    if options.list:
        for case in chosen:
            note = f"  ({case.note})" if case.note else ""
            print(f"{case.id:24} {case.kind:6} {case.review:22} {case.title}{note}")
        return 0
    if not options.out:
        options.out = tempfile.mkdtemp(prefix="gcore-reliability-")
    harness = Harness(options)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"gcore reliability harness: {started:%Y-%m-%d %H:%M} UTC, load {os.getloadavg()[0]:.1f}, "
          f"out {harness.out}", flush=True)
    needs_models = any(c.id.startswith("open.model") for c in chosen)
    fixtures.build(harness.fx, models=needs_models, images=any(c.section == "images" for c in chosen))
    os.makedirs(os.path.join(harness.fx, "outside"), exist_ok=True)
    with open(os.path.join(harness.fx, "outside", "secret.txt"), "w") as f:
        f.write(harness.secret + "\n")
    counts = dict.fromkeys(VERDICTS, 0)
    manual = 0
    rows = ["| case | result | review (aed9ad4) | s | evidence |", "|---|---|---|---:|---|"]
    print("\n".join(rows), flush=True)
    for case in chosen:
        if case.kind == "manual":
            manual += 1
            row = f"| {case.id} | manual | {case.review} | | not run: {case.note} |"
        else:
            load = os.getloadavg()[0]
            verdict, evidence, seconds = harness.run_case(case)
            counts[verdict] += 1
            evidence = evidence.replace("|", "\\|").replace("\n", " ")
            row = f"| {case.id} | {verdict} | {case.review} | {seconds:.0f} | {evidence[:400]} (load {load:.0f}) |"
        rows.append(row)
        print(row, flush=True)
    tried = sum(counts.values())
    summary = (f"\ncases tried: {tried}; " + ", ".join(f"{v} {counts[v]}" for v in VERDICTS)
               + f"; manual (not run): {manual}. Load at the end {os.getloadavg()[0]:.1f}; "
               f"{(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60:.0f} min.")
    print(summary, flush=True)
    with open(os.path.join(harness.out, "table.md"), "w") as f:
        f.write("\n".join(rows) + "\n" + summary + "\n")
    if not options.keep:
        shutil.rmtree(harness.fx, ignore_errors=True)
        shutil.rmtree(harness.runs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
