"""A screenshot of `moeswap serve`'s web page mid-generation, taken in headless chromium.

Starts `moeswap serve MODEL` on a free loopback port (flags this script does not know go to it:
--host-mem, --threads ...), opens the page in Debian's chromium through selenium, types the
prompt, and saves the page once the reply has streamed --wait-chars characters (the expert
grid then shows that step's experts). --background N sends N other completions at the same
time, so that the page shows a batch.

    python scripts/screenshot_server_page.py moeswap/data/stdlib-moe-q8_0.gguf \
        docs/images/server-page.png --prompt "def parse_args(" --host-mem 20MiB --ctx 256 \
        --step-tokens 64 --threads 1
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise SystemExit(f"gave up waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("out", help="the .png to write")
    p.add_argument("--prompt", default="def parse_args(")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--wait-chars", type=int, default=200)
    p.add_argument("--size", default="1200,720", help="window width,height in CSS pixels")
    p.add_argument("--background", type=int, default=0, help="other requests sent meanwhile")
    args, serve_flags = p.parse_known_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen([sys.executable, "-m", "moeswap", "serve", args.model,
                               "--port", str(port), *serve_flags],
                              stdout=subprocess.DEVNULL, stderr=log, text=True)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 f"--window-size={args.size}", "--hide-scrollbars"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        def healthy() -> bool:
            try:
                return httpx.get(url + "health").status_code == 200
            except httpx.HTTPError:
                return server.poll() is not None
        wait_until(healthy, 120, "the server")
        if server.poll() is not None:
            log.seek(0)
            raise SystemExit(f"moeswap serve exited {server.returncode}: {log.read()[-2000:]}")
        driver.get(url)
        wait_until(lambda: driver.find_element(By.ID, "model").text not in ("", "…"), 10,
                   "the page's first poll")
        time.sleep(1.5)  # a few idle polls: the charts' baseline
        for field, value in (("max-tokens", args.max_tokens), ("temperature", 0.7)):
            box = driver.find_element(By.ID, field)
            box.clear()
            box.send_keys(str(value))
        model = driver.find_element(By.ID, "model").text
        for i in range(args.background):
            body = {"model": model, "prompt": f"import os{i}", "max_tokens": args.max_tokens}
            threading.Thread(target=httpx.post, args=(url + "v1/completions",),
                             kwargs={"json": body, "timeout": None}, daemon=True).start()
        driver.find_element(By.ID, "prompt").send_keys(args.prompt, Keys.ENTER)
        reply = "const t = document.querySelectorAll('#transcript .turn.assistant'); " \
                "return t.length ? t[t.length - 1].textContent.length : 0"
        wait_until(lambda: driver.execute_script(reply) >= args.wait_chars, 120, "the reply")
        driver.save_screenshot(args.out)
        print(f"{args.out}: {driver.execute_script(reply)} characters streamed so far")
    finally:
        driver.quit()
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
