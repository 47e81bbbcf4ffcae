"""The HTML report, opened in a real browser (headless Chromium): every plot loads, every table is there."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict

import pytest

from kvevict.ab import run_sweep
from kvevict.report.html import render

import netns
from conftest import make_tiny
from test_ab import CharTokenizer, config

pytestmark = pytest.mark.browser

CHECK = """
<script>
window.addEventListener('load', () => {
  const images = [...document.querySelectorAll('img')].map(i => i.complete && i.naturalWidth > 0);
  const tables = [...document.querySelectorAll('table')].map(t => t.id + ':' + t.querySelectorAll('tbody tr').length);
  document.body.setAttribute('data-check', JSON.stringify({images, tables}));
});
</script>
"""


def chromium() -> list[str]:
    """Chromium's command, inside a network namespace that holds only loopback: at start it looks up Google's
    hosts and connects to public DNS servers whatever its flags say (seen with strace), and the report is a
    file, so it needs no network at all."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: `make test` installs Debian's chromium (apt-get install chromium)")
        pytest.skip("chromium not installed (make test installs it)")
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"chromium runs only in a loopback-only network namespace: {reason}")
    return netns.command([found])


def test_report_renders_in_headless_chromium(tmp_path):
    browser = chromium()
    text = tmp_path / "text.txt"
    text.write_text("A long essay about attention sinks and caches. " * 80)
    cfg = config(tmp_path, text)
    _, records = run_sweep(cfg, model=make_tiny(seed=31), tokenizer=CharTokenizer(), progress=False)
    report = render(records, asdict(cfg), tmp_path / "report.html")
    page = report.read_text().replace("</body>", CHECK + "</body>")
    probe = tmp_path / "probe.html"
    probe.write_text(page)
    profile = tmp_path / "profile"
    proc = subprocess.run(
        [*browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND",
         f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    match = re.search(r"data-check=\"([^\"]+)\"", proc.stdout)
    assert match, proc.stderr[-2000:]
    check = json.loads(match.group(1).replace("&quot;", '"'))
    assert len(check["images"]) == 4 and all(check["images"]), check
    tables = dict(entry.split(":") for entry in check["tables"])
    assert set(tables) == {"summary", "sinks"}
    assert int(tables["summary"]) >= 1 + 2 * (1 + 3) and int(tables["sinks"]) == 2
