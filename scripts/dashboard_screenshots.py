"""The docs' pictures of the dashboard (docs/dashboard.md), taken in headless Chromium from a dashboard that runs.

    areal-agents dashboard runs/arith/rl-2turns runs/arith/rl-2turns-lr3e-4 --port 8790 &
    python scripts/dashboard_screenshots.py http://127.0.0.1:8790 docs/images --step 29 --episode 141

Writes OUT/dashboard.png (the whole page) and OUT/dashboard-trajectory.png (the trajectory viewer on one
episode). Needs chromium, chromium-driver (scripts/setup.sh --with-browser) and selenium (the dev extra).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

WIDTH = 1500


def open_browser() -> webdriver.Chrome:
    options = Options()
    options.binary_location = shutil.which("chromium") or "chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={WIDTH},1200"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver") or "chromedriver"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("--run", default="0", help="the run the trajectory viewer shows (its index)")
    parser.add_argument("--step", help="its step (default: the newest)")
    parser.add_argument("--episode", type=int, default=0, help="the episode's row in that step")
    parser.add_argument("--colour-by", default="mask", choices=["mask", "version", "logprob"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    driver = open_browser()
    wait = WebDriverWait(driver, 60, poll_frequency=0.25)
    try:
        driver.get(args.url)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#panel-reward .scatterlayer .trace"))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#panel-heatmap .hm image"))
        Select(driver.find_element(By.ID, "t-run")).select_by_value(args.run)
        if args.step:
            wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'#t-step option[value="{args.step}"]'))
            Select(driver.find_element(By.ID, "t-step")).select_by_value(args.step)
        row = f'#episodes tr[data-index="{args.episode}"]'
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, row))[0].click()
        wait.until(lambda d: "selected" in d.find_element(By.CSS_SELECTOR, row).get_attribute("class"))
        wait.until(lambda d: d.find_elements(By.ID, "ep-tokens"))
        driver.find_element(By.CSS_SELECTOR, f'input[name="colour-by"][value="{args.colour_by}"]').click()
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(WIDTH, height + 140)
        driver.save_screenshot(str(args.out / "dashboard.png"))
        driver.find_element(By.ID, "trajectories").screenshot(str(args.out / "dashboard-trajectory.png"))
    finally:
        driver.quit()
    print(f"{args.out / 'dashboard.png'}\n{args.out / 'dashboard-trajectory.png'}")


if __name__ == "__main__":
    main()
