"""The example third-party plugin package: installed, it is listed and usable; removed, it is gone."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import FAST

pytestmark = pytest.mark.integration

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "gcore-example-plugin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
         str(target), str(PLUGIN)],
        check=True, capture_output=True, text=True,
    )
    return target


def _gcore(site, *args, cwd):
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "gcore", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


def test_installed_plugin_is_listed_and_used(installed, tmp_path):
    listed = _gcore(installed, "plugins", cwd=tmp_path)
    assert "brevity" in listed.stdout and "reinforce" in listed.stdout
    assert "[gcore-example-plugin 0.1.0]" in listed.stdout
    run = _gcore(installed, "fit", "--trainer.default_root_dir", str(tmp_path), *FAST,
                 "--reward", "brevity", "--reward.max_chars", "8", "--algorithm", "reinforce", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    config = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())
    assert config["reward"] == {"class": "gcore_example_plugin.BrevityReward", "on_error": "raise", "timeout": 30.0,
                                "max_chars": 8}
    assert config["algorithm"]["class"] == "gcore_example_plugin.Reinforce"
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    # FAST generates at most 4 tokens (so at most 4 characters): the brevity reward is at least 1 - 4/8
    assert len(rows) == 2 and all(0.5 <= float(r["reward/mean"]) <= 1 for r in rows)


def test_installed_environment_runs_episodes(installed, tmp_path):
    assert "echo" in _gcore(installed, "plugins", cwd=tmp_path).stdout
    run = _gcore(installed, "fit", "--trainer.default_root_dir", str(tmp_path), *FAST, "--env", "echo",
                 "--data.task", "reveal", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    assert [float(r["env/echoes"]) for r in rows] == [float(r["env/episodes"]) for r in rows]  # every one ended
    assert all(float(r["env/turns_mean"]) == 2.0 for r in rows)


def test_without_the_package_the_names_are_unknown(tmp_path):
    listed = _gcore(None, "plugins", cwd=tmp_path)
    assert "brevity" not in listed.stdout
    run = _gcore(None, "fit", *FAST, "--reward", "brevity", cwd=tmp_path)
    assert run.returncode == 2 and "unknown reward 'brevity'" in run.stderr


def test_plugin_package_own_tests(installed):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(installed), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(PLUGIN / "tests")],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
