"""The browser tests' Chromium: headless Debian chromium driven by Playwright."""
import os

import pytest

from tests.conftest import require
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS


@pytest.fixture(autouse=True)
def chromium():
    """Before anything starts: skip here without Chromium, fail under CI=true."""
    require(os.path.exists(CHROMIUM), "chromium", f"the browser tests drive Debian's chromium at {CHROMIUM} "
                                                  "(`make test` installs it)")


@pytest.fixture
def browser(tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1500, "height": 1300})
        try:
            yield context
        finally:
            context.close()
