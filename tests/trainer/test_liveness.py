"""ControllerWatch on its own: a real rendezvous store (TCPStore) and real child processes, one process."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist
from conftest import FAST

from gcore.liveness import ControllerWatch, describe_exit


def _server():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    return server


def _client(server):
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=5))


def _watch(rank, store, **kwargs):
    kwargs = {"silence_limit": 1.5, "interval": 0.1, "grace": 1e9, **kwargs}  # grace: never end pytest
    return ControllerWatch(rank, 2, store, **kwargs)


def test_exit_codes_are_described():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(2) == "exited with status 2"


def test_a_controller_that_stops_beating_is_named():
    server = _server()
    zero, one = _watch(0, _client(server)), _watch(1, _client(server))
    zero.start()
    one.start()
    assert zero.wait_for_loss(timeout=1.0) == {}  # both beat: nobody is lost
    one._stop.set()  # controller 1 dies without a word: its heartbeats stop
    one._thread.join()
    lost = zero.wait_for_loss(timeout=10.0)
    assert list(lost) == [1] and "no heartbeat" in lost[1]
    zero._stop.set()


def test_every_watch_knows_where_its_peers_run_before_the_first_step():
    """The run trains only after ``start()`` returns. A controller frozen in its first step, with the store
    it hosts if it is controller 0, can no longer be looked up, so ``start()`` waits for the peers' records
    (a freeze 0.3 s into the run hung it when the pids were read only by the first heartbeat)."""
    server = _server()
    zero, one = _watch(0, _client(server), interval=60.0), _watch(1, _client(server), interval=60.0)
    starting = threading.Thread(target=zero.start)
    starting.start()  # it waits for controller 1's record
    time.sleep(0.2)
    one.start()
    starting.join(timeout=10.0)
    here = (socket.gethostname(), os.getpid())
    assert zero._where == {1: here} and one._where == {0: here}
    zero._stop.set()
    one._stop.set()


def test_a_controller_that_finished_or_failed_is_not_lost():
    server = _server()
    zero, one = _watch(0, _client(server)), _watch(1, _client(server))
    zero.start()
    one.start()
    one.stop()  # finished: says "done" first
    assert zero.wait_for_loss(timeout=3.0) == {}
    zero._stop.set()

    zero, one = _watch(0, _client(server)), _watch(1, _client(server))
    server.delete_key("gcore/watch/state/1")
    zero.start()
    one.start()
    one.mark("failed: ValueError: bad reward")
    one._stop.set()
    lost = zero.wait_for_loss(timeout=10.0)
    assert lost == {1: "failed (ValueError: bad reward)"}
    zero._stop.set()


@pytest.mark.integration
def test_a_killed_child_controller_is_named_with_its_signal():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ControllerWatch(0, 2, None, children={1: child}, interval=0.1, grace=1e9)
    watch.start()
    assert watch.wait_for_loss(timeout=0.5) == {}
    child.send_signal(signal.SIGKILL)
    lost = watch.wait_for_loss(timeout=10.0)
    assert lost == {1: f"was killed by SIGKILL (pid {child.pid})"}
    assert watch.describe() == f"controller 1 was killed by SIGKILL (pid {child.pid})"
    watch._stop.set()


@pytest.mark.integration
def test_a_child_that_failed_and_was_then_killed_is_named_by_its_error():
    # a failing controller records why, then may die of a signal on its way out (gloo aborts when a
    # peer is still in a collective): the survivor names the error, not only the signal
    server = _server()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = _watch(0, _client(server), children={1: child}, grace=1e9)
    server.set("gcore/watch/state/1", "failed: RewardError: bad reward")
    child.send_signal(signal.SIGABRT)
    child.wait()
    watch._check_children()
    assert watch.lost == {1: f"failed (RewardError: bad reward; then killed by SIGABRT, pid {child.pid})"}
    assert watch.describe().startswith("controller 1 failed (RewardError: bad reward")


def test_losing_the_store_means_losing_controller_zero():
    server = _server()
    watch = _watch(1, _client(server))
    watch.start()
    assert watch.wait_for_loss(timeout=0.5) == {}
    del server  # controller 0's process hosts the store; it is gone
    lost = watch.wait_for_loss(timeout=10.0)
    assert list(lost) == [0] and "rendezvous store" in lost[0]
    watch._stop.set()


@pytest.mark.integration
def test_a_frozen_controller_zero_is_named_and_ended_although_its_store_hangs():
    """A SIGSTOPped controller 0 freezes the store it hosts: store calls then block (they have no timeout),
    so the watch judges from when the store last answered, names controller 0 and ends its process."""
    code = ("import sys, time, torch.distributed as dist; s = dist.TCPStore('127.0.0.1', 0, is_master=True, "
            "wait_for_workers=False); print(s.port, flush=True); time.sleep(120)")
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(host.stdout.readline())
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=5))
    store.set("gcore/watch/pid/0", f"{socket.gethostname()} {host.pid}")  # as controller 0's watch records it
    watch = _watch(1, store)
    watch.start()
    assert watch.wait_for_loss(timeout=0.5) == {}
    host.send_signal(signal.SIGSTOP)
    lost = watch.wait_for_loss(timeout=30.0)
    assert lost == {0: "is frozen or gone: the rendezvous store it hosts has not answered for 1.5 s; "
                       f"its process {host.pid} was ended"}
    assert host.wait(timeout=30) == -signal.SIGKILL
    watch._stop.set()


def test_controller_zero_does_not_lose_itself_with_the_store():
    server = _server()
    watch = _watch(0, _client(server))
    watch.start()
    del server
    assert watch.wait_for_loss(timeout=1.0) == {}
    watch._stop.set()


#: the frozen-controller test's --trainer.heartbeat_timeout: 5 s named a live controller frozen once, in a fresh clone's
#: suite beside a SmolLM2 run (load 9-11 on the 2 cores: "controller 0 sent no heartbeat for 5 s" before any freeze)
HEARTBEAT_S = 20  # a loaded machine (load 14) starved a store for 10 s once: a false loss


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0])
def test_a_frozen_controller_is_named_and_every_process_ends(tmp_path, victim):
    """A real 2-controller run; one controller is frozen with SIGSTOP mid-run. The other names it within
    ``--trainer.heartbeat_timeout`` (10 s here; 30 s by default) instead of waiting for the 600 s collective
    timeout, and every process of the run ends, the frozen one too. Frozen controller 0 also freezes
    the rendezvous store it hosts: controller 1 finds that out when its store calls time out."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gcore", "fit", *FAST, "--trainer.max_steps", "100000", "--trainer.accelerator", "cpu",
         "--trainer.devices", "2", "--trainer.heartbeat_timeout", str(HEARTBEAT_S), "--trainer.save_final", "false",
         "--trainer.default_root_dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = tmp_path / "gcore" / "version_0" / "metrics.csv"
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None and (
            not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    if process.poll() is not None:  # the whole of what it said, not a shortened repr
        out, err = process.communicate()
        raise AssertionError(f"the run ended (exit {process.returncode}) before a controller was frozen:\n"
                             f"{out[-3000:]}\n{err[-6000:]}")
    children = psutil.Process(process.pid).children()
    assert len(children) == 1  # controller 0 launched controller 1
    frozen = process.pid if victim == 0 else children[0].pid
    os.kill(frozen, signal.SIGSTOP)
    try:
        _, stderr = process.communicate(timeout=180)  # a generous bound: detection takes about HEARTBEAT_S
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"the run hung after controller {victim} was frozen") from None
    deadline = time.time() + 60
    while time.time() < deadline and _alive(process.pid, children[0].pid):
        time.sleep(0.2)
    assert not _alive(process.pid, children[0].pid), "a controller of the run was left behind"
    survivor = 1 - victim
    if victim == 1:
        expected = (f"controller 0: controller 1 sent no heartbeat for {HEARTBEAT_S} s (frozen, killed, or its "
                    f"machine is gone); its process {frozen} was ended")
    else:
        expected = ("controller 1: controller 0 is frozen or gone: "
                    f"the rendezvous store it hosts has not answered for {HEARTBEAT_S} s")
    assert expected in stderr, stderr
    assert f"its process {frozen} was ended" in stderr, stderr
    assert f"controller {survivor}" in stderr and "--trainer.resume auto" in stderr, stderr


def _alive(*pids: int) -> bool:
    """Whether any of ``pids`` still runs (a zombie waiting for its parent does not)."""
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            pass
    return False
