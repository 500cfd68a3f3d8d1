"""The dashboard in a real browser: headless Debian Chromium driven by Playwright,
against the real app (``python -m dashboard``), a real engine host and a real SQLite
store filled by the real collector.

One engine host (session fixture), one dashboard process and one browser for the whole
module; the tests run in order (viewer, operator, live data under load, invalid input,
apply, history, rollback, CSV, every page's screenshot). Screenshots go to
``test-artifacts/dashboard-*.png``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.engine, pytest.mark.browser]

CHROMIUM = os.environ.get("SPECPILOT_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-quic",
    "--no-first-run",
    "--disable-component-update",
    "--disable-sync",
]
HOST = "local"
TOKEN_ENV = "SPECPILOT_BROWSER_TEST_TOKEN"
OPERATOR = ("olga", "operator-pass-1")
VIEWER = ("vic", "viewer-pass-1")
REASON_K = "browser test: K=3 for the incident"
REASON_ROLLBACK = "browser test: back to the imported config"

if not Path(CHROMIUM).exists():
    pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(engine_host, tmp_path_factory, artifacts_dir):
    """Store with the engine host registered, collector running, dashboard serving.

    Yields ``dict(url=dashboard URL, db=store URL, store=Store)``.
    """
    from control import auth
    from control.collector import Collector
    from control.store import Store, add_host

    home = tmp_path_factory.mktemp("dash-home")
    db = f"sqlite:///{home / 'specpilot.db'}"
    users = home / "users.toml"
    auth.add_user(OPERATOR[0], "operator", OPERATOR[1], path=users)
    auth.add_user(VIEWER[0], "viewer", VIEWER[1], path=users)
    os.environ[TOKEN_ENV] = engine_host.token
    store = Store.open(db)
    add_host(store, HOST, engine_host.url, usd_per_hour=1.2, gpu_kind="cpu", token_env=TOKEN_ENV, actor="test")
    collector = Collector(store, interval_s=1.0).start()
    port = _free_port()
    env = dict(os.environ, SPECPILOT_HOME=str(home), SPECPILOT_USERS_FILE=str(users))
    env[TOKEN_ENV] = engine_host.token
    log = open(artifacts_dir / "dashboard.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard", "--port", str(port), "--db", db],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert proc.poll() is None, (artifacts_dir / "dashboard.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/_stcore/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError("dashboard did not come up in 60 s")
        yield {"url": url, "db": db, "store": store}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        collector.stop()
        httpx.put(
            engine_host.url + "/control/config",
            headers=engine_host.control_headers,
            timeout=30,
            json={
                "speculation": {"mode": "fixed", "k": 0, "k_min": 0, "k_max": None},
                "batch": {"max_num_seqs": None, "max_num_batched_tokens": None},
            },
        )
        store.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, stack):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1800}, accept_downloads=True)
    pg = ctx.new_page()
    pg.set_default_timeout(30_000)
    yield pg
    ctx.close()


def login(pg, stack, who) -> None:
    pg.goto(stack["url"])
    pg.get_by_label("User name").fill(who[0])
    pg.get_by_role("textbox", name="Password").fill(who[1])
    pg.get_by_role("button", name="Log in").click()
    pg.get_by_text("Signed in as").wait_for()


def go(pg, title: str) -> None:
    pg.get_by_test_id("stSidebarNav").get_by_role("link", name=title).click()
    pg.get_by_role("heading", name=title, level=1).wait_for()


def visible(locator):
    return locator.filter(visible=True)


def shot(pg, artifacts_dir, name: str) -> None:
    # the app's script run is over (a page that reruns on a timer may be running again after
    # the bounded wait: the screenshot is taken anyway), then charts and tables (canvas) draw
    try:
        pg.locator('[data-testid="stApp"][data-test-script-state="notRunning"]').wait_for(timeout=15_000)
    except sync_api.TimeoutError:
        pass
    time.sleep(1.0)
    pg.screenshot(path=str(artifacts_dir / f"dashboard-{name}.png"), full_page=True)


def state(engine_host) -> dict:
    return httpx.get(engine_host.url + "/control/state", headers=engine_host.control_headers, timeout=30).json()


def _load(engine_host, seconds: float, concurrency: int = 2) -> None:
    model = httpx.get(engine_host.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    stop = time.monotonic() + seconds

    def worker(i: int) -> None:
        with httpx.Client(base_url=engine_host.url, timeout=60) as c:
            n = 0
            while time.monotonic() < stop:
                c.post(
                    "/v1/completions",
                    json={
                        "model": model,
                        "max_tokens": 24,
                        "temperature": 0,
                        "prompt": f"List the planets of the solar system, number {i}.{n}:",
                    },
                )
                n += 1

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_viewer_logs_in_and_sees_no_control_forms(page, stack, artifacts_dir):
    login(page, stack, VIEWER)
    page.get_by_text("vic").first.wait_for()
    go(page, "Control")
    page.get_by_text("read only").first.wait_for()
    assert visible(page.get_by_role("button", name="Preview change")).count() == 0
    assert page.get_by_role("textbox", name="Reason (required)").count() == 0
    shot(page, artifacts_dir, "control-viewer")
    go(page, "History")
    assert page.get_by_role("button", name="Roll back").count() == 0


def test_wrong_password_is_refused(page, stack):
    login_attempt = page
    login_attempt.goto(stack["url"])
    login_attempt.get_by_label("User name").fill(OPERATOR[0])
    login_attempt.get_by_role("textbox", name="Password").fill("not-the-password")
    login_attempt.get_by_role("button", name="Log in").click()
    login_attempt.get_by_text("wrong user name or password").wait_for()
    assert login_attempt.get_by_text("Signed in as").count() == 0


def test_live_charts_fill_while_load_runs(page, stack, engine_host, artifacts_dir):
    login(page, stack, OPERATOR)
    go(page, "Live")
    loader = threading.Thread(target=_load, args=(engine_host, 12.0), daemon=True)
    loader.start()
    # The tiles start empty ("—") and fill from the collector's samples without a reload.
    tile = page.get_by_test_id("stMetric").filter(has_text="TTFT P99")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "ms" not in tile.inner_text():
        time.sleep(1)
    assert "ms" in tile.inner_text(), tile.inner_text()
    out = page.get_by_test_id("stMetric").filter(has_text="Output")
    assert "tok/s" in out.inner_text()
    assert page.get_by_text("samples from the store").count() == 1
    loader.join()
    # The page reruns every few seconds; a count taken mid-rerun can catch the charts being
    # redrawn, so wait (bounded) for all of them to be there at once. On a machine whose two
    # cores are busy with other work a rerun can take tens of seconds.
    charts = page.locator(".js-plotly-plot")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and charts.count() < 8:
        time.sleep(0.5)
    assert charts.count() >= 8
    shot(page, artifacts_dir, "live")


def _versions(stack):
    """The host's config versions in the store, newest first."""
    from control import versions
    from control.views.common import open_store

    return versions.history(open_store(stack["db"]), HOST)


def _speculation_form(pg):
    go(pg, "Control")
    return visible(pg.get_by_test_id("stForm")).filter(
        has=pg.get_by_role("spinbutton", name="K (fixed mode)", exact=True)
    )


def test_invalid_k_shows_inline_error_and_applies_nothing(page, stack, engine_host, artifacts_dir):
    before = state(engine_host)["config_version"]
    login(page, stack, OPERATOR)
    form = _speculation_form(page)
    form.get_by_role("spinbutton", name="K (fixed mode)", exact=True).fill("12")
    form.get_by_role("textbox", name="Reason (required)").fill("browser test: too deep")
    form.get_by_role("button", name="Preview change").click()
    err = page.get_by_text("K=12 is above K_max")
    err.wait_for()
    shot(page, artifacts_dir, "control-invalid")
    assert page.get_by_role("button", name=f"Apply to {HOST}").count() == 0
    assert state(engine_host)["config_version"] == before
    assert all(v.reason != "browser test: too deep" for v in _versions(stack))


def test_operator_changes_k_with_a_reason(page, stack, engine_host, artifacts_dir):
    login(page, stack, OPERATOR)
    form = _speculation_form(page)
    form.get_by_role("spinbutton", name="K (fixed mode)", exact=True).fill("3")
    form.get_by_role("button", name="Preview change").click()
    page.get_by_text("a reason is required").first.wait_for()  # no reason: nothing to review
    form.get_by_role("textbox", name="Reason (required)").fill(REASON_K)
    form.get_by_role("button", name="Preview change").click()
    page.get_by_text(f"Review the change to {HOST}").wait_for()
    shot(page, artifacts_dir, "control-review")
    assert state(engine_host)["speculation"]["k"] == 0  # nothing applied before the confirmation
    page.get_by_role("button", name=f"Apply to {HOST}").click()
    page.get_by_text("Applied: version").wait_for()
    # The K the policy uses for the next step, idle or not (not the last step's K, 0 while idle).
    page.get_by_text("K in force: 3.").wait_for()
    shot(page, artifacts_dir, "control-applied")
    st = state(engine_host)
    assert st["speculation"]["mode"] == "fixed" and st["speculation"]["k"] == 3

    go(page, "History")
    page.get_by_text(f"Reason: {REASON_K}").wait_for()
    assert page.get_by_text(f"Author: {OPERATOR[0]}").count() == 1
    shot(page, artifacts_dir, "history")


def test_operator_rolls_back_from_history(page, stack, engine_host, artifacts_dir):
    target = next(v for v in _versions(stack) if v.status == "applied" and v.config["speculation"]["k"] == 0)
    login(page, stack, OPERATOR)
    go(page, "History")
    page.get_by_test_id("stSelectbox").filter(has_text="Version").click()
    page.keyboard.type(f"{HOST} v{target.version} ")  # the list is virtualised: filter it by typing
    page.get_by_role("option").filter(has_text=f"{HOST} v{target.version} ").first.click()
    form = page.get_by_test_id("stForm").filter(has_text="Roll ")
    form.get_by_text(f"back to v{target.version}").wait_for()
    form.get_by_text("What changes against").wait_for()  # the diff against the config in force
    # The caption is sent before the table: wait for the table itself, then check there is one.
    form.get_by_test_id("stDataFrame").first.wait_for()
    assert form.get_by_test_id("stDataFrame").count() == 1
    form.get_by_role("textbox", name="Reason (required)").fill(REASON_ROLLBACK)
    form.get_by_role("button", name="Roll back").click()  # no tick: refused, the reason stays
    page.get_by_text("Tick the confirmation first.").wait_for()
    assert form.get_by_role("textbox", name="Reason (required)").input_value() == REASON_ROLLBACK
    form.get_by_text("I confirm").click()
    form.get_by_role("button", name="Roll back").click()
    page.get_by_text("Rolled back").wait_for()
    shot(page, artifacts_dir, "history-rollback")
    assert state(engine_host)["speculation"]["k"] == 0
    newest = _versions(stack)[0]
    assert newest.reason == REASON_ROLLBACK and newest.author == OPERATOR[0]
    assert newest.status == "applied"


def test_cost_review_csv_download(page, stack, artifacts_dir):
    login(page, stack, OPERATOR)
    go(page, "Cost review")
    with page.expect_download() as dl:
        page.get_by_role("button", name="Download CSV").click()
    path = artifacts_dir / "dashboard-weekly-report.csv"
    dl.value.save_as(str(path))
    text = path.read_text()
    assert HOST in text and "," in text.splitlines()[0]
    shot(page, artifacts_dir, "cost")
    page.get_by_text("Printable view").click()
    page.get_by_text("SpecPilot weekly cost report").wait_for()
    shot(page, artifacts_dir, "cost-printable")


@pytest.mark.parametrize(
    "title,name", [("Fleet", "fleet"), ("Alerts", "alerts"), ("Planner", "planner"), ("Control", "control")]
)
def test_every_page_screenshot(page, stack, artifacts_dir, title, name):
    login(page, stack, OPERATOR)
    go(page, title)
    assert page.get_by_test_id("stException").count() == 0
    shot(page, artifacts_dir, name)


def test_a_reload_keeps_the_session_and_a_deep_link_opens_its_page(browser, stack, artifacts_dir):
    ctx = browser.new_context(viewport={"width": 1280, "height": 1200})
    try:
        pg = ctx.new_page()
        pg.set_default_timeout(30_000)
        login(pg, stack, VIEWER)
        go(pg, "History")
        pg.reload()
        pg.get_by_text("Signed in as").wait_for()  # still logged in, on the same page
        pg.get_by_role("heading", name="History", level=1).wait_for()
        pg.get_by_role("button", name="Log out").click()
        pg.get_by_role("button", name="Log in").wait_for()
        pg.reload()
        pg.get_by_role("button", name="Log in").wait_for()  # logging out ended the session
        assert pg.get_by_text("Signed in as").count() == 0
    finally:
        ctx.close()
    ctx = browser.new_context(viewport={"width": 1280, "height": 1200})
    try:
        pg = ctx.new_page()
        pg.set_default_timeout(30_000)
        pg.goto(stack["url"] + "/history")
        pg.get_by_label("User name").fill(VIEWER[0])
        pg.get_by_role("textbox", name="Password").fill(VIEWER[1])
        pg.get_by_role("button", name="Log in").click()
        pg.get_by_role("heading", name="History", level=1).wait_for()
        shot(pg, artifacts_dir, "deep-link-history")
    finally:
        ctx.close()


OVERFLOW_JS = """() => [...document.querySelectorAll('[data-testid="stMetric"] *')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 && e.clientWidth > 0)
    .map(e => e.textContent)"""


def test_history_lists_warm_up_and_heartbeat_runs(page, stack, artifacts_dir):
    from control.views import history as history_views

    # the engine host's start-up warm-up runs reach the store through the collector
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and history_views.heartbeat_runs(stack["store"], host=HOST).empty:
        time.sleep(1.0)
    assert not history_views.heartbeat_runs(stack["store"], host=HOST).empty, "no warm-up run reached the store"
    login(page, stack, VIEWER)
    go(page, "History")
    expander = page.get_by_test_id("stExpander").filter(has_text="Warm-up and heartbeat runs")
    expander.get_by_text("Warm-up and heartbeat runs (skips included)").click()
    expander.get_by_test_id("stDataFrame").wait_for()
    assert expander.get_by_text("No warm-up or heartbeat run in this span.").count() == 0
    shot(page, artifacts_dir, "history-runs")


@pytest.fixture(scope="module")
def late_hosts(stack, engine_host):
    """Two hosts registered after the dashboard started, at once, for the module's last tests
    (the dashboard caches its host list for 10 s: one wait serves both): "slow", whose stored
    samples say TTFT P99 24.9 s, ITL P99 19.9 s and 47,620 tokens/s, and "gpu-a", 16
    one-minute points at K = 2 whose latency does not grow with the rate."""
    from control.samples import insert_samples
    from control.store import add_host, remove_host
    from tests.test_planner import _store_with_bad_fit

    store = stack["store"]
    h = add_host(store, "slow", f"http://127.0.0.1:{_free_port()}", usd_per_hour=1.0, token_env=TOKEN_ENV, actor="test")
    now = int(time.time())
    insert_samples(
        store,
        h.id,
        [
            {
                "resolution_s": 1,
                "t": t,
                "covered_s": 1.0,
                "busy_s": 1.0,
                "output_tokens": 47620.0,
                "prompt_tokens": 0.0,
                "requests_finished": 1.0,
                "output_tokens_per_s": 47620.0,
                "ttft_p50_ms": 9870.0,
                "ttft_p95_ms": 19904.0,
                "ttft_p99_ms": 24900.0,
                "itl_p50_ms": 4762.0,
                "itl_p95_ms": 12000.0,
                "itl_p99_ms": 19904.0,
                "kv_cache_usage": 0.973,
                "running": 128.0,
                "waiting": 4762.0,
                "acceptance_rate": 0.999,
                "k": 8.0,
                "config_version": 1,
            }
            for t in range(now - 60, now)
        ],
    )
    _store_with_bad_fit(stack["db"], engine_host.url, time.time())  # host "gpu-a"
    time.sleep(10.5)  # the dashboard's host list is cached for 10 s
    yield
    remove_host(store, "slow", actor="test")
    remove_host(store, "gpu-a", actor="test")


def test_live_tiles_never_cut_a_number_under_high_latency(browser, stack, late_hosts, artifacts_dir):
    """A host whose stored samples say TTFT P99 24.9 s, ITL P99 19.9 s and 47,620
    tokens/s: at 1280 px (and at 800 px) no tile's text overflows its box."""
    for width in (1280, 800):
        ctx = browser.new_context(viewport={"width": width, "height": 1400})
        try:
            pg = ctx.new_page()
            pg.set_default_timeout(30_000)
            login(pg, stack, VIEWER)
            pg.get_by_test_id("stSelectbox").filter(has_text="Host").first.click()
            pg.get_by_role("option", name="slow").click()
            tile = pg.get_by_test_id("stMetric").filter(has_text="TTFT P99")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "24.9 s" not in tile.inner_text():
                time.sleep(0.5)
            assert "24.9 s" in tile.inner_text(), tile.inner_text()
            time.sleep(1.0)
            cut = pg.evaluate(OVERFLOW_JS)
            shot(pg, artifacts_dir, f"live-tiles-{width}")
            assert cut == [], f"tiles cut at {width} px: {cut}"
            assert "…" not in " ".join(pg.get_by_test_id("stMetric").all_inner_texts())
        finally:
            ctx.close()


def test_planner_says_not_enough_data_on_a_bad_fit(browser, stack, late_hosts, artifacts_dir):
    """16 one-minute points at K = 2 whose latency does not grow with the rate (Kong's C2
    would be 0): the page must say "not enough data", never draw that fit as an answer."""
    ctx = browser.new_context(viewport={"width": 1440, "height": 1800})
    try:
        pg = ctx.new_page()
        pg.set_default_timeout(30_000)
        login(pg, stack, VIEWER)
        go(pg, "Planner")
        pg.get_by_test_id("stSelectbox").filter(has_text="Host").first.click()
        pg.get_by_role("option", name="gpu-a").click()
        pg.get_by_text("Fitted check K=2: not enough data").first.wait_for()
        assert pg.get_by_test_id("stException").count() == 0
        assert "Infinity" not in pg.inner_text("body")
        shot(pg, artifacts_dir, "planner-not-enough-data")
    finally:
        ctx.close()
