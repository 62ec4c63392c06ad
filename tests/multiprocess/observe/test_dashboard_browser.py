"""The job page in a real browser (headless Chromium through chromedriver) and its /metrics, on one 2-rank job.

The page must show both ranks, their step counters advancing, and a rank killed with SIGKILL turning to
"failed" with its cause; a wrong token gets 403. The test writes the page's screenshots to build/artifacts/.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import phalanx
from phalanx.errors import WorkerFailedError
from phalanx.observe import server

pytestmark = [pytest.mark.multiprocess]

ARTIFACTS = Path(__file__).resolve().parents[3] / "build" / "artifacts"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
WAIT_S = 90.0


def _train() -> str:
    """Steps until killed (at most 120 s): a small model under phalanx.torch's DistributedOptimizer."""
    import torch

    import phalanx.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    deadline = time.monotonic() + 120
    step = 0
    while time.monotonic() < deadline:
        opt.zero_grad()
        model(torch.randn(16, 64)).sum().backward()
        opt.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step}", flush=True)
        time.sleep(0.02)  # a steady job for the dashboard to show, until the test kills it
    return "not killed"


def _until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.2)


@pytest.fixture
def browser() -> Iterator[Any]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.fail("chromium and chromedriver are needed (make browser installs them: apt-get install chromium "
                    "chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _cell(driver: Any, rank: int, name: str) -> str:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    try:
        return str(driver.find_element("css selector", f'#ranks tr[data-rank="{rank}"] td.{name}').text)
    except (NoSuchElementException, StaleElementReferenceException):
        return ""


def _steps(driver: Any, rank: int) -> int:
    text = _cell(driver, rank, "steps")
    return int(text) if text.isdigit() else -1


def _metrics(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url.replace("/?token=", "/metrics?token="), timeout=10).read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, sample.labels.get("rank", ""))] = sample.value
    return out


def test_page_shows_ranks_steps_and_a_killed_rank(browser: Any) -> None:
    outcome: dict[str, BaseException] = {}

    def job() -> None:
        try:
            phalanx.run(_train, np=2, dashboard=True, start_timeout=WAIT_S)
        except BaseException as e:
            outcome["error"] = e

    runner = threading.Thread(target=job)
    runner.start()
    try:
        page = _until("the job page", lambda: next(iter(server._SERVERS.values()), None))
        _until("the job's board", lambda: page.board is not None and page.board.ended is None)
        browser.get(page.url)
        _until("both ranks on the page", lambda: len(browser.find_elements("css selector", "#ranks tbody tr")) == 2)
        first = _until("rank 0's steps", lambda: _steps(browser, 0) > 0 and _steps(browser, 0))
        _until("rank 0's step counter to advance", lambda: _steps(browser, 0) > first)
        _until("rank 1's step counter", lambda: _steps(browser, 1) > 0)
        assert {_cell(browser, r, "state") for r in (0, 1)} <= {"running", "collective"}

        scraped = _metrics(page.url)
        assert scraped[("phalanx_rank_steps_total", "1")] > 0
        assert scraped[("phalanx_job_ranks_alive", "")] == 2
        assert scraped[("phalanx_rank_collective_wait_seconds_total", "0")] > 0
        assert scraped[("phalanx_rank_reduced_bytes_total", "0")] > 0
        assert ("phalanx_job_start_latency_seconds", "") in scraped
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard-running.png"))

        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(page.url.split("?")[0] + "?token=wrong", timeout=10)
        assert refused.value.code == 403
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(page.url.split("?")[0] + "metrics", timeout=10)
        assert refused.value.code == 403

        os.kill(int(_cell(browser, 1, "pid")), signal.SIGKILL)
        try:
            _until("rank 1 to turn failed", lambda: _cell(browser, 1, "state") == "failed")
        except AssertionError as e:
            rows = [(r["state"], r["cause"]) for r in page.board.snapshot()["ranks"]]
            raise AssertionError(f"{e}; the board: {rows}, the page: {_cell(browser, 1, 'state')}") from e
        assert "SIGKILL" in _cell(browser, 1, "cause")
        report = _until("the failure report", lambda: browser.find_element("id", "end-report").text)
        assert "rank 1" in report and "SIGKILL" in report  # named with its cause, never as "stopped by phalanx"
        assert browser.find_element("id", "status").text == "failed"
        assert _metrics(page.url)[("phalanx_job_up", "")] == 0
        browser.save_screenshot(str(ARTIFACTS / "dashboard-failed.png"))
    finally:
        if runner.is_alive() and "page" in locals() and page.board is not None and page.board.ended is None:
            for row in page.board.snapshot()["ranks"]:  # a failed check: end the job now, not in 120 s
                if row["pid"]:
                    os.kill(row["pid"], signal.SIGKILL)
        runner.join(WAIT_S)
    assert isinstance(outcome.get("error"), WorkerFailedError)
    assert "SIGKILL" in str(outcome["error"])

    browser.get(page.url.replace("token=", "token=x"))
    assert "forbidden" in browser.page_source


def test_64_ranks_fit_a_compact_grid(browser: Any) -> None:
    """A synthetic 64-rank board (no job): one line per rank, the straggler highlighted, logs filtered."""
    from phalanx.job.observation import RankStarted
    from phalanx.job.records import LogLine, Stream
    from phalanx.job.stats import KindStats, RankStats
    from phalanx.observe import JobBoard
    from phalanx.observe.server import Dashboard

    page = Dashboard("127.0.0.1", 0)
    board = JobBoard("phalanx-64ranks", 64)
    page.show(board)
    try:
        for clock in range(1, 8):
            for rank in range(64):
                if clock == 1:
                    board.observe(RankStarted(rank, 20_000 + rank, f"node{rank // 8}", board.started + 0.4))
                slow = rank == 37
                steps, wait = clock * (9 if slow else 10), clock * (0.05 if slow else 0.3 + rank * 0.001)
                board.observe(RankStats(rank, 20_000 + rank, f"node{rank // 8}", float(clock), steps, wait,
                                        steps * 4_000_000, "allreduce" if rank % 5 == 0 else "",
                                        {"allreduce": KindStats(steps, wait, steps * 4_000_000)}))
                board.observe(LogLine(rank, Stream.STDOUT, f"epoch 1 step {steps} loss {1 / (steps + 1):.4f}"))
        browser.get(page.url)
        rows = _until("64 rows", lambda: len(browser.find_elements("css selector", "#ranks tbody tr")) == 64 and
                      browser.find_elements("css selector", "#ranks tbody tr"))
        heights = {row.size["height"] for row in rows}
        assert max(heights) <= 26, f"a rank's row is {max(heights)} px high: not one line"
        assert "straggler" in browser.find_element("css selector", '#ranks tr[data-rank="37"]').get_attribute("class")
        assert browser.find_element("id", "straggler").text == "rank 37"
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "dashboard-64.png"))
        browser.find_element("id", "log-filter").send_keys("step 63")
        lines = _until("the filtered logs", lambda: browser.find_element("id", "logs").text)
        assert "step 63" in lines and "step 70" not in lines
    finally:
        page.close()
