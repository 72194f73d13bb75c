"""Re-run the faults of the reliability review against ``gcore fit``: interrupts, kills, corrupt and
tampered checkpoints, full disks, an unwritable output folder, temp-dir leftovers.

    python benchmarks/faults.py [--workdir DIR] [--skip-multi] [--only TEXT] [--repo CHECKOUT]

Each case runs the real CLI in a subprocess (a tiny model, CPU), injects one fault, then checks what
a user would: the exit code and message, what is on disk, and whether ``--trainer.resume auto``
finishes the run from a complete checkpoint. A case *survives* when the run can be continued (or
the fault is refused with a one-line error and nothing from the checkpoint ran) and *loses data*
when a complete checkpoint, the trained weights, or metrics rows are gone or duplicated. The
full-disk cases mount small tmpfs file systems and need root; without it they are skipped.
Prints one line per case and the counts: faults tried / survived / data lost.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time

FAST = ["--trainer.enable_progress_bar", "false", "--data.prompts_per_step", "4", "--sampling.n", "2",
        "--sampling.max_new_tokens", "4", "--model.num_hidden_layers", "1", "--model.hidden_size", "32",
        "--model.intermediate_size", "64"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the gcore that runs (--repo: another checkout)


def gcore(root: str, *args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", root, *FAST, *args]
    environment = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, **popen)


def run(root: str, *args: str, env: dict | None = None) -> tuple[int, str, str]:
    process = gcore(root, *args, env=env)
    out, err = process.communicate(timeout=600)
    return process.returncode, out, err


def checkpoints(root: str) -> str:
    return os.path.join(root, "gcore", "checkpoints")


def complete(root: str) -> list[str]:
    folder = checkpoints(root)
    return sorted(p for p in glob.glob(os.path.join(folder, "step_*")) if not p.endswith(".tmp")
                  and os.path.isfile(os.path.join(p, "manifest.json")))


def leftovers(root: str) -> list[str]:
    return sorted(glob.glob(os.path.join(checkpoints(root), "*.tmp")))


def metrics_ok(root: str, steps: int) -> bool:
    """One version_N folder whose metrics.csv has every step once."""
    versions = sorted(glob.glob(os.path.join(root, "gcore", "version_*")))
    if len(versions) != 1:
        return False
    with open(os.path.join(versions[0], "metrics.csv")) as f:
        seen = [int(float(r["step"])) for r in csv.DictReader(f)]
    return seen == list(range(steps))


def wait_for(condition, timeout: float = 300) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


# --- cases: each returns (survived, data_lost, note) --------------------------------------------

STEPS = 12
CKPT = ["--trainer.checkpoint_every", "2", "--trainer.save_final", "false"]


def resume_finishes(root: str, env: dict | None = None) -> tuple[bool, bool, str]:
    rc, out, err = run(root, "--trainer.max_steps", str(STEPS), *CKPT, "--trainer.resume", "auto", env=env)
    resumed = next((line for line in out.splitlines() if line.startswith("resumed from")), "started from 0")
    ok = rc == 0 and metrics_ok(root, STEPS)
    return ok, not metrics_ok(root, STEPS), f"resume rc {rc}: {resumed}" + (f"; {last_line(err)}" if rc else "")


def signal_case(sig: int, expected_rc: int):
    def case(root: str) -> tuple[bool, bool, str]:
        process = gcore(root, "--trainer.max_steps", str(STEPS), *CKPT)
        wait_for(lambda: len(complete(root)) >= 1 and leftovers(root))  # a save in flight
        before = complete(root)
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
        note = (f"rc {process.returncode} ({last_line(err.split('gcore: interrupted')[0])}); "
                f".tmp left: {len(leftovers(root))}")
        lost = any(p not in complete(root) for p in before[-1:]) or process.returncode != expected_rc
        ok, lost_after, resumed = resume_finishes(root)
        return ok and process.returncode == expected_rc, lost or lost_after, f"{note}; {resumed}"
    return case


def kill_case(when: str):
    def case(root: str) -> tuple[bool, bool, str]:
        process = gcore(root, "--trainer.max_steps", str(STEPS), *CKPT, start_new_session=True)
        if when == "tmp":
            wait_for(lambda: len(complete(root)) >= 1 and leftovers(root))
        else:
            wait_for(lambda: len(complete(root)) >= 1
                     and glob.glob(os.path.join(checkpoints(root), "*.tmp", "manifest.json*")))
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        ok, lost, resumed = resume_finishes(root)
        return ok, lost, f"SIGKILL at {when}; {resumed}"
    return case


def damaged_latest(damage: str):
    def case(root: str) -> tuple[bool, bool, str]:
        run(root, "--trainer.max_steps", "6", *CKPT)  # checkpoints after steps 3 and 5
        latest = complete(root)[-1]
        data = next(f for f in os.listdir(latest) if f.endswith(".distcp"))
        target = os.path.join(latest, data)
        if damage == "truncate":
            with open(target, "r+b") as f:
                f.truncate(os.path.getsize(target) // 2)
        elif damage == "flip":
            raw = bytearray(open(target, "rb").read())
            raw[len(raw) // 2] ^= 0xFF
            open(target, "wb").write(bytes(raw))
        else:
            os.remove(os.path.join(latest, "manifest.json"))
        rc, out, err = run(root, "--trainer.max_steps", "8", *CKPT, "--trainer.resume", "auto")
        resumed = next((line for line in out.splitlines() if line.startswith("resumed from")), "")
        warned = next((line for line in err.splitlines() if "skipped" in line), "")
        ok = rc == 0 and "step_00000003" in resumed and bool(warned)
        return ok, not metrics_ok(root, 8), f"rc {rc}; {warned[:120]} ... {resumed}"
    return case


def tampered(file: str):
    class Payload:
        def __init__(self, marker: str) -> None:
            self.marker = marker

        def __reduce__(self):
            return (open, (self.marker, "w"))

    def case(root: str) -> tuple[bool, bool, str]:
        import torch

        run(root, "--trainer.max_steps", "4", *CKPT)
        latest = complete(root)[-1]
        marker = os.path.join(root, "PWNED")
        target = os.path.join(latest, file)
        if file.endswith(".pt"):
            torch.save({"rng": Payload(marker)}, target)
        else:
            with open(target, "wb") as f:
                pickle.dump(Payload(marker), f)
        manifest = json.load(open(os.path.join(latest, "manifest.json")))  # reseal: the manifest is not signed
        manifest["files"][file] = {"bytes": os.path.getsize(target),
                                   "sha256": hashlib.sha256(open(target, "rb").read()).hexdigest()}
        json.dump(manifest, open(os.path.join(latest, "manifest.json"), "w"))
        rc, _, err = run(root, "--trainer.max_steps", "6", *CKPT, "--trainer.resume", "auto")
        executed = os.path.exists(marker)
        one_line = err.strip().splitlines()[-1] if err.strip() else ""
        ok = rc == 2 and not executed and "refused" in one_line
        return ok, False, f"rc {rc}, payload ran: {executed}; {one_line[:160]}"
    return case


@contextlib.contextmanager
def tmpfs(path: str, size: str):
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], check=False)


def disk_full_one_checkpoint(root: str) -> tuple[bool, bool, str]:
    """12 MB: room for one checkpoint, not two; then the disk is grown and the run resumed."""
    with tmpfs(os.path.join(root, "disk"), "12m") as disk:
        big = ["--model.hidden_size", "128", "--model.num_hidden_layers", "4", "--model.intermediate_size", "256"]
        rc, _, err = run(disk, "--trainer.max_steps", "8", *CKPT, *big)
        message = last_line(err)
        intact = complete(disk)
        clear = rc == 2 and "disk full" in message and not leftovers(disk)
        subprocess.run(["mount", "-o", "remount,size=64m", disk], check=True)
        rc2, out, _ = run(disk, "--trainer.max_steps", "8", *CKPT, *big, "--trainer.resume", "auto")
        resumed = next((line for line in out.splitlines() if line.startswith("resumed from")), "started from 0")
        ok = clear and bool(intact) and rc2 == 0
        return ok, not metrics_ok(disk, 8), f"rc {rc}: {message[:170]}; after growing the disk: rc {rc2}, {resumed}"


def disk_full_small(root: str) -> tuple[bool, bool, str]:
    with tmpfs(os.path.join(root, "disk"), "2m") as disk:
        big = ["--model.hidden_size", "128", "--model.num_hidden_layers", "4", "--model.intermediate_size", "256"]
        rc, _, err = run(disk, "--trainer.max_steps", "6", *CKPT, *big)
        message = last_line(err)
        return rc == 2 and "disk full" in message and not leftovers(disk), False, f"rc {rc}: {message[:170]}"


def disk_full_final(root: str) -> tuple[bool, bool, str]:
    """No checkpoints; the final save meets a full disk: the weights must still be somewhere."""
    tmp = os.path.join(root, "tmp")
    os.makedirs(tmp)
    with tmpfs(os.path.join(root, "disk"), "1m") as disk:
        big = ["--model.hidden_size", "128", "--model.num_hidden_layers", "4", "--model.intermediate_size", "256"]
        rc, _, err = run(disk, "--trainer.max_steps", "3", *big, env={"TMPDIR": tmp})
        message = last_line(err)
        saved = glob.glob(os.path.join(tmp, "gcore-final-*", "model.safetensors"))
        return rc == 2 and bool(saved), not saved, f"rc {rc}: {message[:200]}"


def read_only(root: str) -> tuple[bool, bool, str]:
    folder = os.path.join(root, "ro")
    os.makedirs(folder)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", folder], check=True)
    try:
        rc, _, err = run(folder, "--trainer.max_steps", "2")
    finally:
        subprocess.run(["umount", "-l", folder], check=False)
    return rc == 2 and "cannot write there" in err and "Traceback" not in err, False, f"rc {rc}: {last_line(err)}"


def temp_leftovers(root: str) -> tuple[bool, bool, str]:
    tmp = os.path.join(root, "tmp")
    os.makedirs(tmp)
    process = gcore(root, "--trainer.max_steps", "100", env={"TMPDIR": tmp}, start_new_session=True)
    wait_for(lambda: glob.glob(os.path.join(root, "gcore", "version_0", "metrics.csv")))
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
    copies = lambda: len(glob.glob(os.path.join(tmp, "gcore-model-*")))  # noqa: E731 (not torch's own caches)
    left = copies()
    run(root, "--trainer.max_steps", "1", env={"TMPDIR": tmp})
    after = copies()
    return left > 0 and after == 0, False, f"after SIGKILL: {left} gcore-model-* folder(s); after the next run: {after}"


def two_controllers_kill_child(root: str) -> tuple[bool, bool, str]:
    import psutil

    two = ["--trainer.devices", "2", "--trainer.accelerator", "cpu"]
    process = gcore(root, "--trainer.max_steps", str(STEPS), *CKPT, *two)
    wait_for(lambda: len(complete(root)) >= 1)
    children = psutil.Process(process.pid).children()
    for child in children:
        child.kill()
    _, err = process.communicate(timeout=300)
    named = "controller 1" in err
    rc, out, _ = run(root, "--trainer.max_steps", str(STEPS), *CKPT, *two, "--trainer.resume", "auto")
    resumed = next((line for line in out.splitlines() if line.startswith("resumed from")), "started from 0")
    return rc == 0 and named, not metrics_ok(root, STEPS), f"killed child named: {named}; resume rc {rc}: {resumed}"


def main() -> int:
    global REPO
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None, help="where the runs go (default: a new temp folder)")
    parser.add_argument("--skip-multi", action="store_true", help="skip the two-controller case")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this text")
    parser.add_argument("--repo", default=REPO,
                        help="the gcore checkout to test (e.g. an older one, for a before/after)")
    args = parser.parse_args()
    REPO = os.path.abspath(args.repo)
    workdir = args.workdir or tempfile.mkdtemp(prefix="gcore-faults-")
    root_only = os.geteuid() == 0
    cases = {
        "SIGINT while a checkpoint is written": signal_case(signal.SIGINT, 130),
        "SIGTERM while a checkpoint is written": signal_case(signal.SIGTERM, 143),
        "SIGKILL with a .tmp checkpoint": kill_case("tmp"),
        "SIGKILL while the manifest is written": kill_case("manifest"),
        "latest checkpoint truncated": damaged_latest("truncate"),
        "latest checkpoint bit flip": damaged_latest("flip"),
        "latest checkpoint manifest deleted": damaged_latest("manifest"),
        "tampered rank_0.pt (pickle payload)": tampered("rank_0.pt"),
        "tampered .metadata (pickle payload)": tampered(".metadata"),
        "killed run's temp copy of the model": temp_leftovers,
    }
    if root_only:
        cases.update({
            "disk full, 12 MB (one checkpoint fits)": disk_full_one_checkpoint,
            "disk full, 2 MB": disk_full_small,
            "disk full at the final save, no checkpoints": disk_full_final,
            "read-only output folder": read_only,
        })
    if not args.skip_multi:
        cases["2 controllers: SIGKILL controller 1"] = two_controllers_kill_child
    if args.only:
        cases = {name: case for name, case in cases.items() if args.only in name}
    tried = survived = lost = 0
    for i, (name, case) in enumerate(cases.items()):
        root = os.path.join(workdir, f"case{i:02d}")
        os.makedirs(root)
        start = time.time()
        try:
            ok, data_lost, note = case(root)
        except Exception as err:  # noqa: BLE001  a harness failure counts as not survived
            ok, data_lost, note = False, False, f"harness error: {type(err).__name__}: {err}"
        tried, survived, lost = tried + 1, survived + ok, lost + data_lost
        print(f"{'ok  ' if ok else 'FAIL'} {'LOST' if data_lost else '    '} {name} "
              f"({time.time() - start:.0f} s): {note}",
              flush=True)
    if not root_only:
        print("(the disk cases need root to mount tmpfs: skipped)")
    print(f"faults tried: {tried}, survived: {survived}, data lost: {lost}")
    shutil.rmtree(workdir, ignore_errors=True) if args.workdir is None else None
    return 0 if survived == tried and lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
