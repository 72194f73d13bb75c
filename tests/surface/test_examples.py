"""Example configs keep parsing, and the example notebook keeps running."""

import json
import os
from pathlib import Path

import pytest
from conftest import run_gcore_here

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.integration
@pytest.mark.parametrize("config", sorted([*EXAMPLES.glob("*.yaml"), *EXAMPLES.glob("real_model/*.yaml")]),
                         ids=lambda p: p.name)
def test_example_config_parses(config, tmp_path):
    """Parsed by the CLI's ``main`` in this process (a fresh process per example only imported gcore again)."""
    result = run_gcore_here("fit", "--config", str(config), "--print_config", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "class_path:" in result.stdout


@pytest.mark.slow
def test_notebook_runs_cell_by_cell(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.chdir(tmp_path)
    notebook = json.loads((EXAMPLES / "notebook.ipynb").read_text())
    namespace: dict = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "notebook.ipynb", "exec"), namespace)
    rewards = namespace["rewards"]
    assert len(rewards) == 15 and rewards[-1] > rewards[0]
    assert os.path.isdir(tmp_path / "gcore_runs")
