"""A headless Chromium page for the web page's tests, driven by Playwright's Python client
over the system's browser (Debian's `chromium` package; Playwright downloads none). Tests
that use it skip, saying which is missing, where there is no browser or no client."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str | None:
    """The browser: $KINETIC_TEST_CHROMIUM, else the first of BROWSERS on the PATH."""
    env = os.environ.get("KINETIC_TEST_CHROMIUM")
    if env:
        return env
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright's Python client is not installed (pip install playwright)"
    if chromium_path() is None:
        return "no Chromium here (Debian's chromium package; or set KINETIC_TEST_CHROMIUM)"
    return None


MISSING = _missing()
needs_browser = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@contextlib.contextmanager
def page():
    """A new page of a headless Chromium, closed after."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        # as root (containers, CI) Chromium refuses to start without --no-sandbox
        args = ["--no-sandbox"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
        browser = p.chromium.launch(executable_path=chromium_path(), args=args)
        try:
            tab = browser.new_page()
            tab.set_default_timeout(120_000)
            yield tab
        finally:
            browser.close()
