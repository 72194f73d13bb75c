"""The run report page (``gcore report`` writes ``report.html``), opened in a real headless browser.

It needs Chromium and its driver from the system (Debian: ``apt-get install chromium chromium-driver``) and
Selenium (``pip install 'gcore[browser]'``); without them the browser test skips, saying which is missing.
"""

import json
import os
import shutil

import pytest
from conftest import run_gcore_here

from gcore.testing import make_sample
from gcore.tracing import Tracer

pytestmark = pytest.mark.integration

HEADER = ("step,reward/mean,reward/std,loss,grad_norm,time/generate,time/train,time/step,"
          "placement/engine_workers,async/staleness_mean\n")


def _run(tmp_path):
    """A run folder: 4 steps of metrics (with placement and async columns) and 3 samples a step traced."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [f"{i},{0.1 * i},0.05,{1.0 - 0.2 * i},0.5,0.3,0.2,0.6,{1 + i % 2},{0.5 * i}\n" for i in range(4)]
    (run / "metrics.csv").write_text(HEADER + "".join(rows))
    tracer = Tracer.open(str(run), 0, every=1, limit=0, max_mb=0, start_step=0)
    for step in range(4):
        samples = [make_sample(f"question {step}.{i} </script>", f"answer {step}.{i}", group=i) for i in range(3)]
        for i, sample in enumerate(samples):
            sample.reward = sample.reward_info["raw"] = 0.5 * i  # 0, 0.5, 1
        tracer.trace(step, samples, [], None)
    return run


def test_report_writes_a_self_contained_page(tmp_path):
    pytest.importorskip("matplotlib")
    run = _run(tmp_path)
    result = run_gcore_here("report", str(run))
    assert result.returncode == 0, result.stderr
    assert f"wrote {run / 'report.html'}" in result.stdout
    page = (run / "report.html").read_text()
    assert "src=" not in page and "<link" not in page  # nothing fetched: no script, style or image from elsewhere
    data = page.split('<script id="data" type="application/json">')[1].split("</script>")[0]
    parsed = json.loads(data.replace("<\\/", "</"))
    assert [p["title"] for p in parsed["panels"]] == ["reward", "loss", "stage times (s)", "placement",
                                                      "async staleness"]
    assert len(parsed["samples"]) == 12 and parsed["samples"][0]["prompt"] == "question 0.0 </script>"


def _browser():
    """A headless Chromium driven by Selenium with the system's browser and driver, or a skip saying what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed: pip install "
                                    "'gcore[browser]' (the report page's browser test)")
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.skip("no Chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver): "
                    "the report page is not opened in a browser")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1800"):
        options.add_argument(flag)
    return webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver_path), options=options)


def test_the_page_renders_in_a_browser_and_filters_samples(tmp_path):
    pytest.importorskip("matplotlib")
    run = _run(tmp_path)
    assert run_gcore_here("report", str(run)).returncode == 0
    driver = _browser()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    def rows():
        return driver.find_elements(By.CSS_SELECTOR, "#samples tbody tr")

    def count():
        return driver.find_element(By.ID, "count").text

    try:
        driver.get("file://" + os.path.abspath(run / "report.html"))
        titles = [h.text for h in driver.find_elements(By.CSS_SELECTOR, ".chart h3")]
        assert titles == ["reward", "loss", "stage times (s)", "placement", "async staleness"]
        paths = driver.find_elements(By.CSS_SELECTOR, ".chart svg path[data-series]")
        assert len(paths) == 9  # every column of metrics.csv but step
        for path in paths:  # 4 points each: a move and 3 lines, inside the chart
            d = path.get_attribute("d")
            assert d.startswith("M") and d.count("L") == 3, d
            assert path.size["width"] > 100  # drawn across the chart
        assert len(rows()) == 12 and count() == "12 of 12 samples"
        Select(driver.find_element(By.ID, "step")).select_by_value("2")
        assert len(rows()) == 3 and count() == "3 of 12 samples"
        assert {r.find_elements(By.TAG_NAME, "td")[0].text for r in rows()} == {"2"}
        driver.find_element(By.ID, "rmin").send_keys("0.5")
        assert [r.find_elements(By.TAG_NAME, "td")[2].text for r in rows()] == ["0.5", "1"]
        Select(driver.find_element(By.ID, "step")).select_by_value("")
        driver.find_element(By.ID, "search").send_keys("answer 3.2")
        assert len(rows()) == 1 and "question 3.2 </script>" in rows()[0].text
        driver.save_screenshot(str(tmp_path / "report.png"))
    finally:
        driver.quit()
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
