"""The web page at / in a real headless browser (Debian's chromium driven by its chromedriver
through selenium), against uvicorn on 127.0.0.1: it loads with no console errors, a typed prompt
streams into the page, and the expert grid changes while the tokens arrive; with --api-key
the page works once the key is typed. The tiny model's store holds 3 of its 8 experts."""

from __future__ import annotations

import re
import shutil
import time
from contextlib import contextmanager

import pytest

from moeswap.experts.build import build_store
from moeswap.experts.settings import OffloadSettings
from moeswap.server.activity import ExpertActivity
from moeswap.server.app import ServerOptions, create_app
from moeswap.server.batching import BatchOptions
from test_server import (MODEL, TEMPLATE, WrappedRuntime, load, one_thread, solo_text,  # noqa: F401
                         write_model)
from test_server_live import serve_app
from test_server_page import CHARGE, CTX, store_sizes

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                       reason="needs Debian's chromium and chromium-driver "
                              "(apt-get install chromium chromium-driver)"),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")

N_TOKENS = 24
STEP_SECONDS = 0.06  # each forward call waits this long, so a reply takes ~1.5 s to stream


class SlowModel:
    def __init__(self, model):
        self.model = model

    def new_cache(self):
        return self.model.new_cache()

    def forward(self, tokens, caches, last_only=False):
        time.sleep(STEP_SECONDS)
        return self.model.forward(tokens, caches, last_only)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("web"), TEMPLATE)


@contextmanager
def page_server(browser, tiny_path, experts: int = 3, name: str = MODEL, **options):
    """The app on a free loopback port under uvicorn: a store holding ``experts`` experts (3 of
    the tiny model's 8)."""
    fixed, slot, _ = store_sizes(tiny_path)
    activity = ExpertActivity()
    factory = build_store(OffloadSettings(host_bytes=fixed + experts * slot), CHARGE)
    runtime = load(tiny_path, expert_runner=factory, recorder=activity)
    slow = WrappedRuntime(runtime, SlowModel)
    app = create_app(slow, ServerOptions(name, BatchOptions(ctx=CTX), **options),
                     activity)
    with serve_app(app) as url:
        yield url + "/"
        browser.get("about:blank")  # a page left polling a stopped server logs errors
        browser.get_log("browser")  # read: the next test sees only its own messages


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1280,800"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def wait_for(condition, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    return None


def console_errors(driver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


GRID = "return [...document.querySelectorAll('#grid .cell')].map(c => c.dataset.tier + ':' + c.dataset.lastUse)"
REPLY = "const t = document.querySelectorAll('#transcript .turn'); return t.length ? [t[t.length - 1].className, t[t.length - 1].textContent] : null"


def ask_and_watch(driver, prompt: str) -> tuple[list[tuple[str, tuple]], str]:
    """Type ``prompt``, press Enter, and record (reply so far, grid) until the reply ends."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    temperature = driver.find_element(By.ID, "temperature")
    temperature.clear()
    temperature.send_keys("0")
    tokens = driver.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(N_TOKENS))
    driver.find_element(By.ID, "prompt").send_keys(prompt, Keys.ENTER)
    seen = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ended = not driver.find_element(By.ID, "stop").is_enabled()  # read first: then the
        reply = driver.execute_script(REPLY)  # reply read after it is whole
        seen.append((reply[1] if reply else "", tuple(driver.execute_script(GRID))))
        if ended and reply and reply[0] != "turn user":
            return seen, reply[0]
        time.sleep(0.03)
    raise AssertionError(f"the reply did not end within 30 s: {seen[-1]}")


def test_the_page_streams_a_reply_while_the_expert_grid_changes(tiny_path, browser):
    messages = [{"role": "user", "content": "bcd"}]
    runtime = load(tiny_path)
    expected = solo_text(runtime, runtime.chat_prompt_ids(messages), N_TOKENS)[0]
    with page_server(browser, tiny_path) as url:
        browser.get(url)
        assert wait_for(lambda: browser.execute_script(
            "return document.getElementById('model').textContent") == MODEL, 10)
        before = tuple(browser.execute_script(GRID))
        assert len(before) == 8 and set(before) == {"disk:"}  # nothing read, nothing used yet
        seen, kind = ask_and_watch(browser, "bcd")
        final = seen[-1][0]
        assert kind == "turn assistant" and final == expected  # greedy: `moeswap run`'s reply
        partial = [(text, grid) for text, grid in seen if 0 < len(text) < len(final)]
        assert len({text for text, _ in partial}) >= 3, seen  # streamed, not all at once
        grids = [grid for _, grid in partial]
        assert len(set(grids)) >= 2, partial  # the grid changed while tokens arrived
        after = seen[-1][1]
        assert sum(cell.startswith("host:") for cell in after) == 3  # the budget: 3 experts
        assert "host:" not in after  # the host tier holds only experts that were used
        assert console_errors(browser) == []


def test_with_an_api_key_the_page_works_once_the_key_is_typed(tiny_path, browser):
    from selenium.webdriver.common.by import By

    with page_server(browser, tiny_path, api_key="s3cret") as url:
        browser.get(url)
        browser.execute_script("localStorage.clear()")
        browser.get(url)
        assert wait_for(lambda: "API key" in browser.find_element(By.ID, "status").text, 10)
        browser.find_element(By.ID, "key").send_keys("s3cret")
        assert wait_for(lambda: browser.find_element(By.ID, "model").text == MODEL, 10)
        seen, kind = ask_and_watch(browser, "bcd")
        assert kind == "turn assistant" and len(seen[-1][0]) > 0
        # the one refused request is the page's first poll, before the key was typed
        errors = console_errors(browser)
        assert errors and all("/v1/moeswap/experts" in e and "401" in e for e in errors), errors


META = "const m = document.querySelectorAll('#transcript .turn-meta'); return m.length ? [m[m.length - 1].dataset.tokens, m[m.length - 1].dataset.tokensPerSecond, m[m.length - 1].textContent] : null"


def text_of(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def test_the_page_shows_experts_held_per_tier_the_expert_axis_and_each_replys_speed(browser):
    """The built-in model, its store holding 20 experts: the held count against the host
    tier's slots, the axis naming the experts, and tokens/s under the reply."""
    import moeswap

    path, name = moeswap.DEFAULT_MODEL, moeswap.DEFAULT_MODEL.stem
    n_experts = load(path).config.n_expert
    with page_server(browser, path, experts=20, name=name) as url:
        browser.get(url)
        assert wait_for(lambda: text_of(browser, "model") == name, 10)
        assert text_of(browser, "expert-axis") == f"expert 0 … {n_experts - 1} →"
        assert text_of(browser, "layer-axis") == "layer ↓"
        assert wait_for(lambda: text_of(browser, "held") == "experts held: host 0 of 20 slots", 10)
        seen, kind = ask_and_watch(browser, "import os")
        assert kind == "turn assistant" and seen[-1][0]
        tokens, rate, text = browser.execute_script(META)
        assert 1 <= int(tokens) <= N_TOKENS
        if int(tokens) > 1:  # decode speed, after the first token
            shown = re.search(r"([0-9.]+) tokens/s", text)  # JS's toFixed(1) of the rate
            # (it and Python's format round a half apart differently: 13.85 -> 13.9 and 13.8)
            assert float(rate) > 0 and shown and abs(float(shown[1]) - float(rate)) <= 0.0501
        assert "first token after" in text

        def held_as_the_grid_shows():
            hosts = sum(cell.startswith("host:") for cell in browser.execute_script(GRID))
            return hosts > 0 and text_of(browser, "held") == f"experts held: host {hosts} of 20 slots"

        assert wait_for(held_as_the_grid_shows, 10), text_of(browser, "held")
        assert console_errors(browser) == []


def test_a_dense_model_shows_weights_kv_and_budget_instead_of_an_empty_grid(browser, tmp_path):
    import tiny_models
    from moeswap.gguf_tools.convert import convert

    tiny_models.save("gemma3", tmp_path / "hf")
    dense = convert(tmp_path / "hf", tmp_path / "dense.q8_0.gguf", "q8_0")
    app = create_app(load(dense), ServerOptions("dense", BatchOptions(ctx=CTX)), ExpertActivity())
    with serve_app(app) as url:
        browser.get(url + "/")
        assert wait_for(lambda: browser.execute_script(
            "return !document.getElementById('memory').hidden"), 10)
        visible = browser.execute_script("return ['grid', 'axes', 'legend', 'held'].map(id => "
                                         "document.getElementById(id).offsetParent !== null)")
        assert visible == [False, False, False, False]
        assert text_of(browser, "cache-title") == "Memory"
        assert text_of(browser, "m-weights").endswith(" MiB")
        assert text_of(browser, "m-kv").endswith(f"(8 × {CTX} positions, f32)")
        assert text_of(browser, "m-budget") == "no --host-mem: what RAM holds"
        widths = browser.execute_script("return [...document.querySelectorAll('#memory .part')]"
                                        ".map(p => p.getBoundingClientRect().width)")
        assert all(w > 0 for w in widths[:2]), widths  # weights and KV drawn
        seen, kind = ask_and_watch(browser, "bcd")
        assert kind == "turn assistant" and browser.execute_script(META) is not None
        browser.get("about:blank")
        assert console_errors(browser) == []
