"""The Chromium the browser tests drive: Debian's, headless, through Playwright."""
import os

# Debian's chromium, as `make test` installs it; pointing this elsewhere hides it (to check that
# CI=true fails a test whose part is missing).
CHROMIUM = os.environ.get("FABTRAIN_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
