import hashlib

import pytest
from conftest import run_gcore_here  # gcore report through the CLI's main, in this process

pytestmark = pytest.mark.integration


def _write(run, rewards):
    header = "step,reward/mean,reward/std,response_length/mean,loss,entropy,time/generate,time/train,time/step\n"
    lines = [f"{i},{r},0.1,{10 + i},0.0,4.0,0.1,0.05,0.2\n" for i, r in enumerate(rewards)]
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text(header + "".join(lines))


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_report_renders_pngs_that_follow_the_data(tmp_path):
    pytest.importorskip("matplotlib")
    _write(tmp_path / "a", [0.1, 0.2, 0.3, 0.4])
    _write(tmp_path / "b", [0.4, 0.1, 0.4, 0.1])
    result = run_gcore_here("report", str(tmp_path / "a"))
    assert result.returncode == 0, result.stderr
    assert "reward/mean: first 2 steps 0.1500, last 2 steps 0.3500" in result.stdout
    assert "time/step: 0.200 s (generate 50%, train 25%)" in result.stdout
    assert run_gcore_here("report", str(tmp_path / "b")).returncode == 0
    a, b = tmp_path / "a" / "plots" / "reward.png", tmp_path / "b" / "plots" / "reward.png"
    assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _digest(a) != _digest(b)
    # the same data gives the same picture
    assert run_gcore_here("report", str(tmp_path / "a"), "--out", str(tmp_path / "again")).returncode == 0
    assert _digest(tmp_path / "again" / "reward.png") == _digest(a)


def test_report_on_a_folder_without_metrics(tmp_path):
    result = run_gcore_here("report", str(tmp_path))
    assert result.returncode == 2 and "no metrics.csv" in result.stderr
