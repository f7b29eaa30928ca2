"""The dashboard at ``/ui`` in a real headless Chromium, against a real daemon process with live container
sandboxes (``debian-python``), a trajectory, failed commands and a failed create.

Chromium is Debian's package, driven by playwright (which is told where it is and never downloads a
browser). The page is checked for what it shows -- nodes, sandboxes (and its filters), rates, failures by
reason, the image cache, pools, the audit trail, a trajectory's steps, lifecycle events arriving live --
and screenshots are saved under ``tests/artifacts/``.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import dsec
from container_support import daemon_process

if TYPE_CHECKING:
    from playwright.async_api import Browser

pytestmark = [pytest.mark.root, pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Headless, no GPU, and nothing that talks to the network on its own.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-default-apps", "--disable-sync", "--no-first-run", "--disable-extensions",
                 "--metrics-recording-only", "--disable-domain-reliability", "--no-pings"]


@dataclass
class Node:
    url: str
    """The daemon's TCP address (the dashboard's)."""
    token: str
    unix_url: str
    """Its unix socket (the test's SDK calls)."""


@pytest.fixture(scope="module")
def node(debian_python_image: object) -> Iterator[Node]:
    """A daemon process with TCP on loopback, a token and a warm pool; every sandbox is gone afterwards."""
    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is not installed (scripts/setup installs it)")
    token = secrets.token_hex(16)
    with daemon_process("dsec-ui-", tcp_token=token, DSEC_POOLS="debian-python:container:min=1,max=1,memory=256Mi"
                        ) as (unix_url, tcp_url):
        assert tcp_url is not None
        yield Node(tcp_url, token, unix_url)


@pytest.fixture
async def browser() -> AsyncIterator[object]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


async def test_dashboard_shows_live_sandboxes_activity_failures_and_trajectories(node: Node, browser: object
                                                                                 ) -> None:
    from playwright.async_api import Browser

    assert isinstance(browser, Browser)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    async with dsec.Client(node.unix_url) as client:
        await _show_everything(node, browser, client)


async def _show_everything(node: Node, browser: Browser, client: dsec.Client) -> None:
    from playwright.async_api import Page, expect

    a = await dsec.AsyncSandbox.create(image="debian-python", labels={"team": "rl"}, memory="256Mi", client=client)
    b = await dsec.AsyncSandbox.create(image="debian-python", labels={"team": "eval"}, memory="256Mi",
                                       client=client)
    rollout = await dsec.AsyncSandbox.create(image="debian-python", trajectory="job-ui/rollout-0", memory="256Mi",
                                             client=client)
    try:
        await a.exec("echo '<b>not html</b>'; python3 -c 'print(6*7)'")
        await a.exec("exit 3")
        await b.exec("sleep 5", timeout=0.3)
        await rollout.exec("echo step-one > notes.txt")
        await rollout.files.write("/workspace/answer.txt", b"42\n")
        await rollout.exec("cat notes.txt answer.txt")
        with pytest.raises(dsec.ImageNotFound):
            await dsec.AsyncSandbox.create(image="no-such-image", client=client)

        page: Page = await browser.new_page(viewport={"width": 1400, "height": 1800})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(f"{node.url}/ui/#token={node.token}")
        await page.wait_for_selector("body[data-ready='1']", timeout=30_000)

        # Nodes and load; sandboxes with their labels; the audit trail with who ran what.
        await expect(page.locator("#nodes tbody tr")).to_have_count(1)
        sandboxes = page.locator("#sandboxes tbody")
        for sb in (a, b, rollout):
            await expect(sandboxes).to_contain_text(sb.id)
        await expect(sandboxes).to_contain_text("team=rl")
        audit = page.locator("#audit tbody")
        await expect(audit).to_contain_text("exit 3")
        await expect(audit).to_contain_text("sleep 5")
        await expect(audit).to_contain_text("limit (time)")
        await expect(page.locator("#failures tbody")).to_contain_text("ImageNotFound")
        await expect(page.locator("#failures tbody")).to_contain_text("limit:time")
        await expect(page.locator("#image-stats")).to_contain_text("chunk cache")
        await expect(page.locator("#images tbody")).to_contain_text("debian-python")
        await expect(page.locator("#pools tbody")).to_contain_text("debian-python:container")
        await expect(page.locator("#totals")).to_contain_text("commands")
        # Rates come from two polls: after a few, the create and exec charts have a line.
        await expect(page.locator("#chart-exec polyline")).to_have_count(1, timeout=15_000)
        await page.screenshot(path=str(ARTIFACTS / "dashboard-overview.png"), full_page=True)

        # Filters: by label, then by backend (none are vms).
        await page.fill("#f-label", "team=eval")
        await expect(page.locator("#sandboxes tbody tr")).to_have_count(1)
        await expect(sandboxes).to_contain_text(b.id)
        await page.fill("#f-label", "")
        await page.select_option("#f-backend", "vm")
        await expect(page.locator("#sandboxes tbody tr")).to_have_count(0)
        await page.select_option("#f-backend", "")

        # A sandbox's command history, with its output shown as text (never as HTML).
        await page.locator(f"#sandboxes tbody tr[data-id='{a.id}']").click()
        detail = page.locator("#detail tbody")
        await expect(detail).to_contain_text("<b>not html</b>")
        await expect(detail).to_contain_text("42")
        assert await page.locator("#detail b").count() == 0

        # A trajectory and its step list.
        await page.locator("#trajectories tbody tr").filter(has_text="job-ui/rollout-0").click()
        steps = page.locator("#steps tbody tr")
        await expect(steps).to_have_count(3)
        await expect(page.locator("#steps tbody")).to_contain_text("step-one")
        await expect(page.locator("#steps tbody")).to_contain_text("write")
        await page.screenshot(path=str(ARTIFACTS / "dashboard-sandbox-and-trajectory.png"), full_page=True)

        # Live updates without reloading: a destroy shows up in the events and leaves the table.
        await b.close()
        await expect(page.locator("#events li[data-kind='destroyed']")).to_contain_text(b.id, timeout=15_000)
        await expect(sandboxes).not_to_contain_text(b.id, timeout=15_000)
        c = await dsec.AsyncSandbox.create(image="debian-python", labels={"team": "late"}, memory="256Mi",
                                           client=client)
        try:
            await expect(sandboxes).to_contain_text(c.id, timeout=15_000)
            await expect(page.locator("#events")).to_contain_text(c.id)
        finally:
            await c.close()
        await page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)
        assert errors == []
    finally:
        for sb in (a, b, rollout):
            await sb.close()


async def test_dashboard_asks_for_a_token_and_shows_nothing_without_one(node: Node, browser: object) -> None:
    from playwright.async_api import Browser, expect

    assert isinstance(browser, Browser)
    page = await browser.new_page()
    await page.goto(f"{node.url}/ui/")
    await expect(page.locator("#token-form")).to_be_visible(timeout=15_000)
    await expect(page.locator("#status")).to_contain_text("needs a token")
    assert await page.locator("#sandboxes tbody tr").count() == 0
    await page.fill("#token-input", node.token)
    await page.click("#token-form button")
    await page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    await expect(page.locator("#nodes tbody tr")).to_have_count(1)
