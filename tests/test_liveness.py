"""ControllerWatch on its own: a real rendezvous store (TCPStore) and real child processes, one process."""

import signal
import subprocess
import sys
from datetime import timedelta

import torch.distributed as dist

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


def test_losing_the_store_means_losing_controller_zero():
    server = _server()
    watch = _watch(1, _client(server))
    watch.start()
    assert watch.wait_for_loss(timeout=0.5) == {}
    del server  # controller 0's process hosts the store; it is gone
    lost = watch.wait_for_loss(timeout=10.0)
    assert list(lost) == [0] and "rendezvous store" in lost[0]
    watch._stop.set()


def test_controller_zero_does_not_lose_itself_with_the_store():
    server = _server()
    watch = _watch(0, _client(server))
    watch.start()
    del server
    assert watch.wait_for_loss(timeout=1.0) == {}
    watch._stop.set()
