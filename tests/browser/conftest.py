"""The browser tests' Chromium: headless Debian chromium driven by Playwright."""
import os

import pytest

from tests.conftest import require

# Debian's chromium, as `make test` installs it; pointing this elsewhere hides it (to check that
# CI=true fails a test whose part is missing).
CHROMIUM = os.environ.get("FABTRAIN_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


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
