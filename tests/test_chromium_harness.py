"""The Chromium harness against a page served by a real local HTTP server.

The page fetches JSON after a timer, draws it on a canvas and records what it drew, so the test
shows that timers, fetch and canvas all ran before the DOM was dumped.
"""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from chromium_harness import dump_dom, elements

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>canvas check</title></head>
<body>
<canvas id="chart" width="200" height="100" data-points="0"></canvas>
<script>
setTimeout(async () => {
  const values = await (await fetch("data.json")).json();
  const canvas = document.getElementById("chart");
  const ctx = canvas.getContext("2d");
  ctx.strokeStyle = "#c00";
  ctx.lineWidth = 3;
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = 10 + i * 40, y = 90 - v * 8;
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  const pixels = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
  let painted = 0;
  for (let i = 3; i < pixels.length; i += 4) if (pixels[i] > 0) painted++;
  canvas.dataset.points = String(values.length);
  canvas.dataset.painted = String(painted);
}, 500);
</script>
</body></html>
"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def site(tmp_path: Path) -> Iterator[str]:
    (tmp_path / "index.html").write_text(PAGE)
    (tmp_path / "data.json").write_text("[1, 4, 2, 8, 5]")
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_dump_dom_sees_what_the_page_script_drew(site: str) -> None:
    html = dump_dom(site, virtual_time_ms=3000)
    [canvas] = elements(html, "canvas")
    assert canvas.attrs["data-points"] == "5"
    assert int(canvas.attrs["data-painted"]) > 100


def test_a_page_that_cannot_load_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="chromium gave no DOM"):
        dump_dom("file:///nonexistent/rollwave/page.html", virtual_time_ms=500)
