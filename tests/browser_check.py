"""Load an HTML report in headless Chromium, check that its images render and that every
table fits a 1400 px window, save a screenshot.

Usage: python tests/browser_check.py report.html screenshot.png

The report carries a tiny inline script that, once the page has loaded, draws each image onto
a canvas and writes how many rendered onto ``<body data-images-ok data-images-total>``;
``--dump-dom`` prints the DOM after scripts ran, so the counts come back without DevTools. The
same script writes how many tables reach past the page's width (``data-tables-wide``), which
`table_widths` reads in a window of `WINDOW_WIDTH` px.

Chromium is Debian's ``chromium`` package; see `INSTALL_HINT` (a font package too, since
without recommends none may come with it). Set ``CHROMIUM`` to use another binary.
Network, sync and component updates are off, so the page is checked offline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import image as mpimg

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",  # the tests run as root in a container, where the sandbox cannot start
    "--disable-gpu",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)
INSTALL_HINT = (
    "apt-get update && apt-get install -y --no-install-recommends chromium fonts-dejavu-core"
)
MIN_SCREENSHOT_BYTES = 10_000


class BrowserCheckError(RuntimeError):
    """The page did not render as expected, or Chromium could not run."""


def find_chromium() -> str | None:
    """The Chromium binary: $CHROMIUM if set, else the first known name on PATH."""
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    for name in CHROMIUM_NAMES:
        if found := shutil.which(name):
            return found
    return None


def _run(chromium: str, args: list[str], timeout: float) -> str:
    # A fresh profile per run: no state from an earlier run, nothing written to $HOME.
    with tempfile.TemporaryDirectory(prefix="ctseg-chromium-") as profile:
        command = [chromium, *FLAGS, f"--user-data-dir={profile}", *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise BrowserCheckError(f"chromium timed out after {timeout} s: {command}") from exc
    if done.returncode != 0:
        raise BrowserCheckError(
            f"chromium exited {done.returncode}: {command}\n{done.stderr[-2000:]}"
        )
    return done.stdout


WINDOW_WIDTH = 1400  # the window every table must fit (issue 25: a laptop's browser)


def _body_attrs(chromium: str, page: Path, timeout: float, width: int) -> dict[str, str]:
    """The data-* attributes the page's script wrote on <body>, in a window `width` px wide."""
    # Virtual time lets the load event run before the DOM dump, however busy the machine.
    dom = _run(
        chromium,
        [
            f"--window-size={width},900",
            "--virtual-time-budget=15000",
            "--dump-dom",
            page.resolve().as_uri(),
        ],
        timeout,
    )
    body = re.search(r"<body[^>]*>", dom)
    if body is None:
        raise BrowserCheckError(f"{page}: no <body> in chromium's DOM dump")
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(0)))
    if attrs.get("images-checked") != "done":
        raise BrowserCheckError(
            f"{page}: the page's image check did not run (body tag: {body.group(0)[:300]})"
        )
    return attrs


def image_counts(chromium: str, page: Path, timeout: float = 120) -> tuple[int, int]:
    """(images that rendered, images in the page), as the page's own check recorded them."""
    attrs = _body_attrs(chromium, page, timeout, WINDOW_WIDTH)
    return int(attrs["images-ok"]), int(attrs["images-total"])


def table_widths(
    chromium: str, page: Path, width: int = WINDOW_WIDTH, timeout: float = 120
) -> dict[str, Any]:
    """In a window `width` px wide: the page's width, its tables, how many reach past the page
    and the right edge of the widest, as the page's script measured them."""
    attrs = _body_attrs(chromium, page, timeout, width)
    keys = ("page-width", "tables-total", "tables-wide", "tables-widest")
    if not all(k in attrs for k in keys):
        raise BrowserCheckError(f"{page}: the page's table check did not run ({attrs})")
    widths: dict[str, Any] = {k.replace("-", "_"): int(attrs[k]) for k in keys}
    if "tables-first-wide" in attrs:  # the first header cell of the first table too wide
        widths["first_wide"] = attrs["tables-first-wide"]
    return widths


def screenshot(
    chromium: str, page: Path, png: Path, size: tuple[int, int] = (1200, 3000), timeout: float = 120
) -> Path:
    png.parent.mkdir(parents=True, exist_ok=True)
    png.unlink(missing_ok=True)
    _run(
        chromium,
        [
            f"--screenshot={png.resolve()}",
            f"--window-size={size[0]},{size[1]}",
            "--virtual-time-budget=15000",
            page.resolve().as_uri(),
        ],
        timeout,
    )
    if not png.exists():
        raise BrowserCheckError(f"chromium wrote no screenshot to {png}")
    return png


def check_screenshot(png: Path) -> dict[str, Any]:
    """The screenshot is a real PNG with content: big enough and not one flat colour."""
    size = png.stat().st_size
    if size < MIN_SCREENSHOT_BYTES:
        raise BrowserCheckError(f"{png}: screenshot only {size} bytes: the page looks blank")
    pixels = mpimg.imread(png)
    spread = float(np.asarray(pixels, dtype=float).std())
    if spread < 0.01:
        raise BrowserCheckError(f"{png}: screenshot is uniform (pixel std {spread:.4f})")
    return {"bytes": size, "shape": tuple(pixels.shape), "pixel_std": spread}


def check_page(page: Path, png: Path, timeout: float = 120) -> dict[str, Any]:
    """Run both checks; raise BrowserCheckError unless every image decoded and the shot is real."""
    chromium = find_chromium()
    if chromium is None:
        raise BrowserCheckError(f"chromium is not on PATH; install it with: {INSTALL_HINT}")
    start = time.perf_counter()
    ok, total = image_counts(chromium, page, timeout)
    dom_s = time.perf_counter() - start
    if total == 0 or ok != total:
        raise BrowserCheckError(f"{page}: {ok} of {total} images decoded in chromium")
    widths = table_widths(chromium, page, timeout=timeout)
    if widths["tables_wide"]:
        raise BrowserCheckError(
            f"{page}: {widths['tables_wide']} of {widths['tables_total']} tables are wider than "
            f"the page in a {WINDOW_WIDTH} px window (widest ends at "
            f"{widths['tables_widest']} px of {widths['page_width']}; the first is headed "
            f"{widths.get('first_wide')!r})"
        )
    start = time.perf_counter()
    screenshot(chromium, page, png, timeout=timeout)
    shot_s = time.perf_counter() - start
    return {
        "chromium": chromium,
        "images_ok": ok,
        "images_total": total,
        **widths,
        "dump_dom_s": round(dom_s, 2),
        "screenshot_s": round(shot_s, 2),
        "screenshot": str(png),
        **check_screenshot(png),
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    try:
        result = check_page(Path(args[0]), Path(args[1]))
    except BrowserCheckError as exc:
        print(f"browser check FAILED: {exc}", file=sys.stderr)
        return 1
    print(" ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
