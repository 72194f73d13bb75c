import sys

import pytest

from gcore import registry
from gcore.errors import PluginError


def test_builtins_are_found_through_entry_points():
    assert {"grpo"} <= set(registry.names("algorithm"))
    assert {"hf"} <= set(registry.names("engine"))
    assert {"static", "dynamic"} <= set(registry.names("placement"))
    assert {"torch"} <= set(registry.names("backend"))
    assert {"target_char", "regex", "python"} <= set(registry.names("reward"))
    assert registry.resolve("algorithm", "grpo") == "gcore.algorithms.grpo.GRPO"
    assert registry.load("algorithm", "grpo").__name__ == "GRPO"


def test_unknown_name_lists_valid_choices():
    with pytest.raises(PluginError, match=r"unknown algorithm 'nope'; valid choices: .*grpo"):
        registry.resolve("algorithm", "nope")
    assert registry.resolve("algorithm", "my_pkg.MyAlgo") == "my_pkg.MyAlgo"


def test_a_broken_plugin_is_reported_and_the_others_still_load(tmp_path, monkeypatch):
    # a real installed distribution (a .dist-info folder on sys.path) whose plugin fails to import
    dist = tmp_path / "broken_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[gcore.algorithms]\nbroken = broken_plugin_mod:Algo\n[gcore.rewards]\nfine = fine_plugin_mod:Reward\n"
    )
    (tmp_path / "broken_plugin_mod.py").write_text("raise ImportError('needs a library that is missing')\n")
    (tmp_path / "fine_plugin_mod.py").write_text(
        "from gcore.rewards import RuleReward\n"
        "class Reward(RuleReward):\n    def score_one(self, sample):\n        return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.discover.cache_clear()
    try:
        algorithms = {p.name: p for p in registry.discover("algorithm")}
        assert "needs a library that is missing" in algorithms["broken"].error
        assert algorithms["broken"].package == "broken-plugin 1.0"
        assert "grpo" in registry.names("algorithm") and "broken" not in registry.names("algorithm")
        assert "fine" in registry.names("reward")
        with pytest.raises(PluginError, match=r"algorithm plugin 'broken' \(from broken-plugin 1.0\) failed"):
            registry.resolve("algorithm", "broken")
    finally:
        registry.discover.cache_clear()
        sys.modules.pop("fine_plugin_mod", None)
