"""Headless Chromium for tests that look at a page the way a person does (selenium + Debian's
`chromium` and `chromium-driver`, which .ci/run installs).

Outside CI a machine without Chromium skips those tests with the reason; under CI=true a
missing browser fails them, so they can never silently stop running.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
DRIVER = "chromedriver"


def _find() -> tuple[str | None, str | None]:
    browser = next((p for p in map(shutil.which, CHROMIUM) if p), None)
    return browser, shutil.which(DRIVER)


def require_chromium() -> tuple[str, str]:
    """Paths of the browser and its driver; skip (fail under CI=true) when missing."""
    browser, driver = _find()
    if browser and driver:
        return browser, driver
    reason = "headless Chromium missing: apt-get install -y chromium chromium-driver"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: this test must run)")
    pytest.skip(reason)


@contextmanager
def chromium(width: int = 1500, height: int = 1000) -> Iterator[Any]:
    """A headless Chromium WebDriver, quit on exit."""
    browser, driver = require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):  # fmt: skip
        options.add_argument(arg)
    session = webdriver.Chrome(options=options, service=Service(driver))
    session.set_page_load_timeout(30)
    session.set_script_timeout(10)
    try:
        yield session
    finally:
        session.quit()


def canvas_ink(session: Any, element_id: str) -> int:
    """How many pixels of a canvas are drawn (non-transparent): 0 for a blank chart."""
    return int(
        session.execute_script(
            "const c = document.getElementById(arguments[0]);"
            "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
            "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n;",
            element_id,
        )
    )


def table(session: Any, table_id: str) -> list[list[str]]:
    """The rows of a table as a person reads them, each a list of its cells' text (read in one
    go: the status page redraws its tables every 2 s)."""
    return session.execute_script(
        "return [...document.querySelectorAll(`#${arguments[0]} tbody tr`)]"
        ".map(r => [...r.cells].map(c => c.innerText.trim()));",
        table_id,
    )
