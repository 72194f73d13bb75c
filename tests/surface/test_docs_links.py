"""The project's markdown links resolve (scripts/check_links.py), and the records stay out of the front door:
the README carries no date, BENCHMARKS.md stays an index."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("check_links", ROOT / "scripts" / "check_links.py")
assert _SPEC is not None and _SPEC.loader is not None
check_links = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check_links)


def test_every_relative_link_and_anchor_resolves():
    problems = check_links.broken_links(ROOT)
    assert not problems, "broken links (python scripts/check_links.py):\n" + "\n".join(problems)
    assert len(check_links.markdown_files(ROOT)) >= 20  # README, BENCHMARKS, CONTRIBUTING, docs/, results


def test_anchors_follow_githubs_rules():
    # anchors GitHub gave these headings, as the repo's links used them before this checker existed
    assert check_links.slug("`--trainer.oversample` on the 2-core CPU: no difference (issue 34)"
                            ) == "--traineroversample-on-the-2-core-cpu-no-difference-issue-34"
    assert check_links.slug("The pool sends a request behind a weight sync: K = 1 generation idle 66-70% -> 41-45%"
                            ) == "the-pool-sends-a-request-behind-a-weight-sync-k--1-generation-idle-66-70---41-45"
    assert check_links.slug("Simulator calibrated on issue 31's workload: held-out error 14.8%"
                            ) == "simulator-calibrated-on-issue-31s-workload-held-out-error-148"
    assert check_links.slug("[LoRA](x.md) adapters (`--backend.lora_rank`)") == "lora-adapters---backendlora_rank"


def test_the_checker_reports_missing_files_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## Same\n\n## Same\n\n<a id=\"kept\"></a>\n\n```\n## Not a heading\n[x](missing-in-code.md)\n```\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#same-1) [ok](docs/a.md#kept) [ok](docs/) [web](https://example.org/none)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#same-2) [code heading](docs/a.md#not-a-heading)\n"
        "`[not a link](nowhere.md)` [self](#nothing-here)\n")
    problems = check_links.broken_links(tmp_path)
    assert len(problems) == 4, problems
    assert problems[0] == "README.md:2: docs/b.md: no such file"
    assert "#same-2" in problems[1] and "#not-a-heading" in problems[2]
    assert problems[3].startswith("README.md:3: #nothing-here: no heading")


def test_the_readme_carries_no_date_and_benchmarks_is_an_index():
    readme = (ROOT / "README.md").read_text()
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert not dates, f"README.md carries dates {dates}: dated figures go to benchmarks/results/, the README links"
    index = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(index) <= 300, f"BENCHMARKS.md has {len(index)} lines: move dated entries to benchmarks/results/"
