"""Headless Chromium for tests: load a URL, let its JavaScript run, return the DOM it left.

Debian's ``chromium`` with ``--dump-dom`` and a virtual time budget: the page's timers and fetches
run until the budget is spent (virtual time waits for pending network loads), then the serialised
DOM is printed. Each run gets a fresh profile directory, and the browser's process group is killed
if it outlives the timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from html.parser import HTMLParser

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-dev-shm-usage",
    "--mute-audio",
)


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("chromium not found: install the Debian package `chromium` (`make test` does)")


def dump_dom(url: str, virtual_time_ms: int = 5000, timeout_s: float = 60.0, window: str = "1280,900") -> str:
    """The DOM of ``url`` after ``virtual_time_ms`` of virtual time, as HTML text."""
    with tempfile.TemporaryDirectory(prefix="rollwave-chromium-") as profile:
        argv = [
            chromium_binary(),
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={window}",
            f"--virtual-time-budget={virtual_time_ms}",
            "--dump-dom",
            url,
        ]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise TimeoutError(f"chromium did not finish {url} in {timeout_s}s; stderr:\n{err[-3000:]}") from None
        finally:
            _reap_group(proc.pid)
    if proc.returncode != 0 or "<html" not in out.lower():
        raise RuntimeError(f"chromium gave no DOM for {url} (exit {proc.returncode}); stderr:\n{err[-3000:]}")
    if 'class="neterror"' in out:  # Chromium 150 and later dump their own error page for a URL that failed
        codes = sorted(set(re.findall(r"\bERR_[A-Z_]+", out)))
        raise RuntimeError(f"chromium gave no DOM for {url}: it showed its error page ({', '.join(codes)})")
    return out


def _reap_group(pgid: int) -> None:
    """Chromium's helper processes share its process group; none may outlive the test."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[Element] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append(Element(tag, {k: v or "" for k, v in attrs}))


def elements(html: str, tag: str | None = None) -> list[Element]:
    """Start tags of ``html`` (optionally only ``tag``) with their attributes, in document order."""
    parser = _Collector()
    parser.feed(html)
    return [e for e in parser.elements if tag is None or e.tag == tag]
