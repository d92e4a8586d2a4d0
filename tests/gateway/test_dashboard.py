"""/admin/ui in a real headless Chromium, against a live server under traffic.

Chromium is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON
messages separated by NUL bytes on file descriptors 3 and 4), so no driver or browser
download is needed: only Debian's `chromium` package. Without it the test skips, or
fails when the CI variable is set (CI must run it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer

CHARTS = ("queue", "slo", "refusals", "tenants", "workers")
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--remote-debugging-pipe",
)


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed: CI must install Debian's chromium package")
    pytest.skip("chromium is not installed (apt-get install chromium)")


class Browser:
    """A headless Chromium with one page, spoken to over the DevTools pipe."""

    def __init__(self, path: str, profile_dir: str) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4.
        self.proc = subprocess.Popen(
            [path, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # The child moves the pipe ends to 3 and 4; keeping 3 and 4 open past exec.
            pass_fds=(3, 4),
            preexec_fn=lambda: (os.dup2(to_browser_r, 3), os.dup2(from_browser_w, 4)),
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.session_id: str | None = None
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        attached = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)
        self.session_id = attached["sessionId"]
        self.call("Runtime.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if self.session_id is not None and not method.startswith("Target."):
            message["sessionId"] = self.session_id
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def evaluate(self, expression: str) -> Any:
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"still false after {timeout_s} s: {expression}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


@pytest.fixture(scope="module")
def live_database_url(tmp_path_factory) -> str:
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('dashboard') / 'tiergate.db'}"


@pytest.fixture
def browser(tmp_path) -> Iterator[Browser]:
    path = chromium_path()
    browser = Browser(path, str(tmp_path / "profile"))
    try:
        yield browser
    finally:
        browser.close()


class Traffic:
    """Background requests from two tiers, plus refusals, until stopped."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.stop = threading.Event()
        self.num_done = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        limited_key = self.server.new_key("interactive", rpm=1)
        with (
            self.server.client(self.server.keys["interactive"]) as interactive,
            self.server.client(self.server.keys["priority"]) as priority,
            self.server.client(limited_key) as limited,
        ):
            while not self.stop.is_set():
                try:
                    for client in (interactive, priority):
                        # An SLO the gateway cannot meet is refused up front ("not now").
                        with contextlib.suppress(openai.RateLimitError):
                            client.completions.create(
                                model="tiny-random", prompt="traffic", max_tokens=3, temperature=0
                            )
                        self.num_done += 1
                    with pytest.raises(openai.NotFoundError):
                        interactive.completions.create(model="nope", prompt="x", max_tokens=1)
                    # One request a minute: the second and later are refused.
                    with contextlib.suppress(openai.RateLimitError):
                        limited.completions.create(model="tiny-random", prompt="x", max_tokens=1)
                except BaseException as exc:
                    self.errors.append(exc)
                    return


@pytest.mark.slow
def test_dashboard_shows_live_data_and_edits_a_tier(
    live_server: LiveServer, browser: Browser
) -> None:
    traffic = Traffic(live_server)
    traffic.thread.start()
    try:
        browser.call("Page.enable")
        browser.call(
            "Page.navigate", url=f"{live_server.base_url}/admin/ui/#token={live_server.admin_token}"
        )
        # Every chart draws data points, from the live numbers.
        points = browser.wait_for(
            "(() => { const c = [...document.querySelectorAll('[data-chart]')];"
            " const p = Object.fromEntries(c.map(e => [e.dataset.chart, +(e.dataset.points||0)]));"
            " return Object.values(p).length === 5 && Object.values(p).every(v => v > 0) && p; })()"
        )
        assert set(points) == set(CHARTS)
        assert browser.evaluate("document.querySelectorAll('.chart svg path').length") >= 2
        assert browser.evaluate("location.hash") == ""  # the token left the URL
        refusals = browser.wait_for(
            "(() => { const r = window.tiergate.live.refusals;"
            " return r && r.rate_limit_exceeded > 0 && r; })()"
        )
        # A client's own mistake (an unknown model) is not the service refusing it.
        assert "model_not_found" not in refusals
        tenants = {t["tenant_id"] for t in browser.evaluate("window.tiergate.live.top_tenants")}
        assert live_server.tenant_ids["interactive"] in tenants
        workers = browser.evaluate("window.tiergate.live.workers")
        # The fleet's workers (here the one in this process) as the queue reports them,
        # under the same id.
        [worker] = browser.evaluate("window.tiergate.queues.workers.data")
        assert [w["id"] for w in workers] == [worker["id"]]
        row = f'#workers-table tr[data-worker="{worker["id"]}"]'
        cells = browser.wait_for(
            f"(() => {{ const r = document.querySelector('{row}');"
            " return r && [...r.children].map(c => c.textContent); })()"
        )
        assert cells[0] == worker["id"]
        assert len(cells) == 9

        # Edit the interactive tier through the form: an unreachable TTFT SLO.
        browser.wait_for("document.querySelector('#tier-form select').options.length >= 3")
        browser.evaluate(
            "(() => { const f = document.getElementById('tier-form');"
            " f.elements.name.value = 'interactive';"
            " f.elements.name.dispatchEvent(new Event('change'));"
            " for (const [k, v] of [['ttft_slo_ms', '0.001'], ['max_concurrency', '7']]) {"
            "   f.elements[k].value = v;"
            "   f.elements[k].dispatchEvent(new Event('input', {bubbles: true})); }"
            " f.requestSubmit(); })()"
        )
        status = browser.wait_for(
            "document.getElementById('tier-status').textContent.startsWith('saved')"
            " && document.getElementById('tier-status').textContent"
        )
        assert status == "saved interactive"
        with live_server.admin() as admin:
            tier = admin.get("/tiers/interactive").json()
        assert tier["ttft_slo_ms"] == 0.001
        assert tier["max_concurrency"] == 7
        browser.wait_for(
            "document.querySelector('#tiers-table tr[data-tier=interactive]').children[3]"
            ".textContent === '0.001'"
        )

        # The change takes effect: new interactive requests now miss their SLO (served
        # late, or refused up front as unattainable), which the dashboard shows.
        time.sleep(1.5)  # telemetry re-reads the tier SLOs every second
        # The page shows what its last poll brought: wait for a poll made after the
        # change took effect, or requests met before it still arrive after this read.
        seen = browser.evaluate(_requests_total("interactive"))
        browser.wait_for(f"{_requests_total('interactive')} > {seen}", 30)
        met_before = browser.evaluate(_met_total("interactive"))
        requests_before = browser.evaluate(_requests_total("interactive"))
        try:
            browser.wait_for(f"{_requests_total('interactive')} >= {requests_before} + 4", 30)
        finally:
            assert traffic.errors == []
        assert browser.evaluate(_met_total("interactive")) <= met_before + 1  # one in flight
        assert browser.evaluate(_met_total("priority")) > 0  # other tiers still meet theirs
        assert traffic.errors == []
    finally:
        traffic.stop.set()
        traffic.thread.join(timeout=60)
        with live_server.admin() as admin:
            admin.patch("/tiers/interactive", json={"ttft_slo_ms": 2000.0, "max_concurrency": None})


def test_the_tier_form_follows_other_admins_without_losing_an_edit(
    live_server: LiveServer, browser: Browser
) -> None:
    browser.call("Page.enable")
    browser.call(
        "Page.navigate", url=f"{live_server.base_url}/admin/ui/#token={live_server.admin_token}"
    )
    browser.wait_for("(document.querySelector('#tier-form select')?.options.length ?? 0) >= 3")
    # The operator picks the batch tier and starts typing a new RPM limit.
    browser.evaluate(
        "(() => { const f = document.getElementById('tier-form');"
        " f.elements.name.value = 'batch';"
        " f.elements.name.dispatchEvent(new Event('change'));"
        " f.elements.rpm.value = '55';"
        " f.elements.rpm.dispatchEvent(new Event('input', {bubbles: true})); })()"
    )
    choices = "[...document.querySelector('#tier-form select').options].map(o => o.value)"
    typed = "document.getElementById('tier-form').elements.rpm.value"
    with live_server.admin() as admin:
        before = admin.get("/tiers/batch").json()
        try:
            # Another admin adds a tier: it is offered, and the typing is left alone.
            admin.post("/tiers", json={"name": "ui-a", "rank": 8}).raise_for_status()
            browser.wait_for(f"{choices}.includes('ui-a')")
            assert browser.evaluate(typed) == "55"
            # One deleted and another made between two polls: the count stays, the
            # choices change.
            admin.delete("/tiers/ui-a").raise_for_status()
            admin.post("/tiers", json={"name": "ui-b", "rank": 8}).raise_for_status()
            browser.wait_for(f"{choices}.includes('ui-b') && !{choices}.includes('ui-a')")
            assert browser.evaluate(typed) == "55"
            assert browser.evaluate("document.querySelector('#tier-form select').value") == (
                "batch"
            )
            # Another admin changes the tier's TPM meanwhile; the operator's save sends
            # only the RPM it typed, and leaves the TPM as the other admin set it.
            admin.patch("/tiers/batch", json={"tpm": 12345}).raise_for_status()
            browser.wait_for(
                "document.querySelector('#tiers-table tr[data-tier=batch]').children[8]"
                ".textContent === '12345'"
            )
            browser.evaluate("document.getElementById('tier-form').requestSubmit()")
            browser.wait_for("document.getElementById('tier-status').textContent === 'saved batch'")
            saved = admin.get("/tiers/batch").json()
            assert (saved["rpm"], saved["tpm"]) == (55, 12345)
            # Untouched, the form follows the tier as others change it.
            admin.patch("/tiers/batch", json={"tpm": 777}).raise_for_status()
            browser.wait_for("document.getElementById('tier-form').elements.tpm.value === '777'")
        finally:
            admin.delete("/tiers/ui-a")
            admin.delete("/tiers/ui-b")
            admin.patch("/tiers/batch", json={"rpm": before["rpm"], "tpm": before["tpm"]})


def _requests_total(tier: str) -> str:
    return f"window.tiergate.live.slo_series.reduce((n, b) => n + (b.requests['{tier}'] || 0), 0)"


def _met_total(tier: str) -> str:
    return f"window.tiergate.live.slo_series.reduce((n, b) => n + (b.met['{tier}'] || 0), 0)"


def test_dashboard_page_is_public_but_its_data_is_not(live_server: LiveServer) -> None:
    page = httpx.get(f"{live_server.base_url}/admin/ui/")
    assert page.status_code == 200
    assert "data-chart" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(f"{live_server.base_url}/admin/ui/static/app.js").status_code == 200
    assert httpx.get(f"{live_server.base_url}/admin/ui/static/nope.js").status_code == 404
    assert httpx.get(f"{live_server.base_url}/admin/ui/api/live").status_code == 401
    live = httpx.get(
        f"{live_server.base_url}/admin/ui/api/live",
        headers={"authorization": f"Bearer {live_server.admin_token}"},
    )
    assert live.status_code == 200
    assert {t["name"] for t in live.json()["tiers"]} >= {"priority", "interactive", "batch"}
