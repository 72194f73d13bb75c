"""Faults and tampering (issue #18): planted pickles, full disks, interrupts, corrupt checkpoints,
damaged model files, unwritable output, mismatched resumes, temp-dir leftovers, the rendezvous store."""

import contextlib
import csv
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

import pytest
import torch
from conftest import FAST
from lightning_fabric import Fabric

from gcore import GRPO, PPO, DataConfig, ModelConfig, SamplingParams, TorchBackend, Trainer, TrainerConfig
from gcore.checkpoint import CheckpointError, CheckpointManager, latest_checkpoint, pick_checkpoint, rng_state, verify
from gcore.errors import ConfigError, GcoreError
from gcore.model import ModelSource, char_tokenizer, check_weights, make_workdir, materialize

TINY = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64}


def _backend(tmp_path, seed=0):
    path = materialize(ModelConfig(**TINY), char_tokenizer(), seed, str(tmp_path / f"model{seed}"))
    backend = TorchBackend(lr=1e-2)
    backend.setup(Fabric(accelerator="cpu", devices=1), ModelSource(path), GRPO(kl_coef=0.0), embedded=True)
    return backend


def _reseal(path, name):
    """What a tamperer does: recompute a file's entry in the (unsigned) manifest."""
    manifest_path = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_path))
    file = os.path.join(path, name)
    manifest["files"][name] = {"bytes": os.path.getsize(file),
                               "sha256": hashlib.sha256(open(file, "rb").read()).hexdigest()}
    json.dump(manifest, open(manifest_path, "w"))


class _Payload:
    """Unpickling this creates ``marker``: the code-execution proof of the review."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _saved(tmp_path, backend, step=1, root="ckpt", **kwargs):
    manager = CheckpointManager(str(tmp_path / root), **kwargs)
    manager.save(step, backend.state_dict(), {"step": step}, {"rng": rng_state()}, asynchronous=False)
    return manager, latest_checkpoint(str(tmp_path / root))


# --- security ---------------------------------------------------------------------------------

def test_planted_payload_in_rank_state_is_refused(tmp_path):
    backend = _backend(tmp_path)
    manager, path = _saved(tmp_path, backend)
    marker = tmp_path / "pwned"
    torch.save({"rng": _Payload(str(marker))}, os.path.join(path, "rank_0.pt"))
    _reseal(path, "rank_0.pt")
    with pytest.raises(CheckpointError, match=r"rank_0.pt: refused: it holds Python objects"):
        manager.load(path, backend.state_dict())
    assert not marker.exists()


def test_planted_payload_in_dcp_metadata_is_refused(tmp_path):
    backend = _backend(tmp_path)
    manager, path = _saved(tmp_path, backend)
    marker = tmp_path / "pwned"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Payload(str(marker)), f)
    _reseal(path, ".metadata")
    with pytest.raises(CheckpointError,
                       match=r"\.metadata: refused: (builtins|io)\.open is not part of DCP's metadata"):
        manager.load(path, backend.state_dict())
    assert not marker.exists()


def test_planted_payload_in_a_dcp_item_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    dcp.save({"plain": {"lr": 0.1}, "evil": _Payload(str(marker))}, checkpoint_id=str(tmp_path / "c"))
    from gcore.checkpoint import dcp_load

    state = {"plain": {"lr": 0.0}}
    dcp_load(state, str(tmp_path / "c"))  # plain data still loads
    assert state["plain"]["lr"] == 0.1 and not marker.exists()
    with pytest.raises(CheckpointError, match="checkpoint item 'evil': refused"):
        dcp_load({"evil": None}, str(tmp_path / "c"))
    assert not marker.exists()


def test_rank_state_of_older_gcore_still_loads(tmp_path):
    from gcore.checkpoint import load_rank_state, set_rng_state

    torch.save({"rng": rng_state(), "extra_sampler": {"epoch": 1}}, tmp_path / "rank_0.pt")  # numpy array inside
    state = load_rank_state(str(tmp_path / "rank_0.pt"))
    set_rng_state(state["rng"])
    assert state["extra_sampler"] == {"epoch": 1}


def test_rendezvous_store_listens_on_loopback_only():
    from gcore.rendezvous import AGENT_STORE, loopback_store

    fabric = Fabric(accelerator="cpu", devices=2)
    before = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", AGENT_STORE)}
    with loopback_store(fabric, num_nodes=1, timeout_s=10) as store:
        port = int(os.environ["MASTER_PORT"])
        assert store is not None and os.environ[AGENT_STORE] == "True"
        listening = _listeners(port)
        assert listening == {"127.0.0.1"}, listening
        client = torch.distributed.TCPStore("127.0.0.1", port, None, False)
        client.set("k", "v")
        assert store.get("k") == b"v"
    assert {k: os.environ.get(k) for k in before} == before  # a later run starts clean
    with loopback_store(Fabric(accelerator="cpu", devices=2), num_nodes=2, timeout_s=10) as store:
        assert store is None  # multi-node: torch's store, which the other machines must reach


def _listeners(port):
    """Local addresses listening on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        if not os.path.exists(table):
            continue
        for line in open(table).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # LISTEN
                if width == 8:
                    found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
                else:
                    found.add("::" if int(address, 16) == 0 else address)
    return found


# --- full disk --------------------------------------------------------------------------------

@contextlib.contextmanager
def small_disk(path, size):
    """A tmpfs of ``size`` mounted at ``path`` (root only)."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True, check=False).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(folder, leave):
    """Fill the file system of ``folder`` until ``leave`` bytes are free."""
    free = shutil.disk_usage(folder).free
    with open(os.path.join(folder, "filler"), "wb") as f:
        f.write(b"\0" * max(0, free - leave))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_full_disk_names_the_path_keeps_the_last_checkpoint_and_leaves_no_tmp(tmp_path, asynchronous):
    backend = _backend(tmp_path)
    with small_disk(tmp_path / "disk", "8m") as disk:
        manager, first = _saved(tmp_path, backend, root="disk/ckpt")
        _fill(disk, leave=64 * 1024)
        with pytest.raises(CheckpointError) as err:
            manager.save(2, backend.state_dict(), {"step": 2}, {"rng": rng_state()}, asynchronous=asynchronous)
            manager.wait()
        message = str(err.value)
        assert "disk full while writing checkpoint step 2" in message and str(disk / "ckpt") in message
        assert "needs about" in message and "MB free" in message and f"last complete checkpoint is {first}" in message
        assert sorted(os.listdir(disk / "ckpt")) == ["step_00000001"]  # no .tmp left
        verify(first)


def test_full_disk_on_save_without_root_is_reported_too(tmp_path, monkeypatch):
    """The same report where no small file system can be mounted: the write fails with ENOSPC."""
    import errno

    backend = _backend(tmp_path)
    manager, _ = _saved(tmp_path, backend)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match=r"disk full while writing checkpoint step 2 \(needs about"):
        manager.save(2, backend.state_dict(), {"step": 2}, {"rng": rng_state()}, asynchronous=False)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000001"]


def _trainer(root, steps=2, **kwargs):
    model = {**TINY, **kwargs.pop("model", {})}
    algorithm = kwargs.pop("algorithm", GRPO())
    return Trainer(trainer=TrainerConfig(max_steps=steps, default_root_dir=str(root), enable_progress_bar=False,
                                         **kwargs),
                   model=ModelConfig(**model), data=DataConfig(prompts_per_step=4),
                   sampling=SamplingParams(n=2, max_new_tokens=4), algorithm=algorithm)


def test_final_save_on_a_full_disk_keeps_the_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tmp_path / "tmp")
    with small_disk(tmp_path / "disk", "48k") as disk, \
            pytest.raises(GcoreError, match="disk full while writing the final policy") as err:
        # logs fit, the model not
        _trainer(disk, steps=1).fit()
    message = str(err.value)
    assert "the trained policy was saved to" in message
    fallback = message.rsplit("saved to ", 1)[1].split(" instead")[0]
    assert os.path.isfile(os.path.join(fallback, "model.safetensors"))
    assert fallback.startswith(str(tmp_path / "tmp"))


# --- resume -----------------------------------------------------------------------------------

def test_resume_auto_passes_over_a_corrupt_latest_checkpoint(tmp_path):
    backend = _backend(tmp_path)
    manager, first = _saved(tmp_path, backend, keep_last=3)
    manager.save(3, backend.state_dict(), {"step": 3}, {"rng": rng_state()}, asynchronous=False)
    latest = latest_checkpoint(str(tmp_path / "ckpt"))
    data = next(f for f in os.listdir(latest) if f.endswith(".distcp"))
    with open(os.path.join(latest, data), "r+b") as f:
        f.truncate(100)
    path, manifest, notes = pick_checkpoint(str(tmp_path / "ckpt"))
    assert path == first and manifest["step"] == 1
    assert len(notes) == 1 and f"{data}: truncated or corrupted" in notes[0] and notes[0].endswith("skipped")


def test_resumed_run_keeps_one_metrics_file_with_unique_steps(tmp_path, capsys):
    _trainer(tmp_path, steps=4, checkpoint_every=2, save_final=False).fit()  # checkpoints after steps 1 and 3
    shutil.rmtree(tmp_path / "gcore" / "checkpoints" / "step_00000003")  # lost: steps 2-3 are redone
    _trainer(tmp_path, steps=5, checkpoint_every=2, save_final=False, resume="auto").fit()
    assert "at step 2" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "gcore")) == ["checkpoints", "version_0"]
    rows = list(csv.DictReader(open(tmp_path / "gcore" / "version_0" / "metrics.csv")))
    assert [int(float(r["step"])) for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["reward/mean"] for r in rows)


def test_resume_with_another_model_size_or_algorithm_is_one_line(tmp_path):
    _trainer(tmp_path, steps=2, checkpoint_every=2, save_final=False).fit()
    with pytest.raises(CheckpointError, match=r"written with another model: --model.hidden_size 32 \(this run: 48\)"):
        _trainer(tmp_path, steps=3, save_final=False, resume="auto", model={"hidden_size": 48}).fit()
    with pytest.raises(CheckpointError, match=r"written by a run with --algorithm gcore.algorithms.grpo.GRPO, this run "
                                              r"has gcore.algorithms.ppo.PPO"):
        _trainer(tmp_path, steps=3, save_final=False, resume="auto", algorithm=PPO()).fit()


# --- bad model files, output folder, temp dir ----------------------------------------------------

@pytest.mark.parametrize("damage", ["header", "truncate", "missing"])
def test_damaged_model_weights_are_one_line_errors(tmp_path, damage):
    path = materialize(ModelConfig(**TINY), char_tokenizer(), 0, str(tmp_path / "m"))
    weights = os.path.join(path, "model.safetensors")
    if damage == "header":
        with open(weights, "r+b") as f:
            f.write(b"\xff" * 64)
        match = "model.safetensors: corrupt or truncated safetensors file"
    elif damage == "truncate":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
        match = "model.safetensors: corrupt or truncated safetensors file"
    else:
        os.remove(weights)
        match = "no weights"
    with pytest.raises(ConfigError, match=match):
        check_weights(path)
    with pytest.raises(ConfigError, match=match):
        materialize(ModelConfig(path=path), char_tokenizer(), 0, str(tmp_path / "unused"))


@contextlib.contextmanager
def _read_only(folder):
    """``folder`` (created, empty) takes no new file while the block runs: a read-only mount as root (root
    writes through file modes), else mode 555."""
    os.makedirs(folder, exist_ok=True)
    mounted = False
    if os.geteuid() == 0:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                                 capture_output=True, check=False).returncode == 0
        if not mounted:
            pytest.skip("needs a read-only mount")
    else:
        os.chmod(folder, 0o555)
    try:
        yield
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)
        else:
            os.chmod(folder, 0o755)


def test_read_only_output_folder_is_a_one_line_error(tmp_path):
    folder = tmp_path / "ro"
    with _read_only(folder), pytest.raises(ConfigError, match=rf"--trainer.default_root_dir {folder}: cannot write "
                                                              "there"):
        _trainer(folder).fit()


def test_a_checkpoint_or_resumed_run_folder_that_takes_no_file_is_refused_before_the_model_is_built(
        tmp_path, monkeypatch):
    # before: the run trained until its first save (checkpoints/ read-only), or failed with a traceback from the
    # CSV logger after resuming (another user's version_0/)
    _trainer(tmp_path, steps=1, checkpoint_every=1, save_final=False).fit()
    checkpoints, version = tmp_path / "gcore" / "checkpoints", tmp_path / "gcore" / "version_0"

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the run's folders were checked")

    monkeypatch.setattr("gcore.trainer.materialize", built)
    with _read_only(tmp_path / "other" / "gcore" / "checkpoints"), \
            pytest.raises(ConfigError, match=r"/other/gcore/checkpoints: cannot write there \(.+\); checkpoints are "
                                             r"written there \(--trainer.checkpoint_every\)$"):
        _trainer(tmp_path / "other", checkpoint_every=1).fit()
    assert checkpoints.is_dir()
    with _read_only(version), pytest.raises(ConfigError, match=r"/gcore/version_0: cannot write there \(.+\); a "
                                                                r"resumed run continues its metrics"):
        _trainer(tmp_path, steps=2, resume="auto").fit()


def test_temp_copies_of_dead_runs_are_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    os.makedirs(tmp_path / f"gcore-model-{dead.pid}-abc")  # what a SIGKILLed run leaves
    os.makedirs(tmp_path / f"gcore-model-{os.getpid()}-live")  # a running one's: kept
    mine = make_workdir()
    assert sorted(os.listdir(tmp_path)) == sorted([f"gcore-model-{os.getpid()}-live", os.path.basename(mine)])


# --- interrupts (a real process and signal) -----------------------------------------------------

@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_finishes_the_save_and_says_where_to_resume(tmp_path, sig):
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    os.makedirs(tmp_path / "tmp")
    cmd = [sys.executable, "-m", "gcore", "fit", "--trainer.default_root_dir", str(tmp_path), *FAST,
           "--trainer.max_steps", "100000", "--trainer.checkpoint_every", "1", "--trainer.save_final", "false"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    checkpoints = tmp_path / "gcore" / "checkpoints"
    deadline = time.time() + 240
    while time.time() < deadline and not (latest_checkpoint(str(checkpoints))
                                          and any(p.name.endswith(".tmp") for p in checkpoints.glob("step_*"))):
        time.sleep(0.01)  # signal while a save is in flight, after one is complete
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + sig, err
    assert f"gcore: {sig.name} during step" in err and "with --trainer.resume auto" in err, err
    assert not [p for p in checkpoints.iterdir() if p.name.endswith(".tmp")]  # finished, not abandoned
    last = latest_checkpoint(str(checkpoints))
    assert f"continue it from {last}" in err
    verify(last)
    assert os.listdir(tmp_path / "tmp") == []  # the embedded model's temp copy is gone
