"""The audit's HTML report in headless Chromium: the fidelity plot loads, the streams' and tasks' tables are there."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from audit_fake import FakeConfig, FakeServer
from kvevict.audit.client import Endpoint
from kvevict.audit.report import write_report
from kvevict.audit.run import AuditSpec, run_audit
from kvevict.loading import load_tokenizer
from test_report_browser import CHECK, chromium

pytestmark = pytest.mark.browser


def test_audit_report_renders_in_headless_chromium(tmp_path):
    browser = chromium()
    tokenizer = load_tokenizer("smollm2-135m")
    with FakeServer(FakeConfig(n_ctx=128), tokenizer) as dep, FakeServer(FakeConfig(n_ctx=1024), tokenizer) as ref:
        spec = AuditSpec(deployment=Endpoint(dep.url), reference=Endpoint(ref.url), prompt_tokens=16,
                         new_tokens=200, generation_trials=2, task_length=120, out=tmp_path / "audit")
        result = run_audit(spec)
    page = write_report(result, tmp_path / "report.html").read_text()
    assert "sink-loss signature" in page
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", CHECK + "</body>"))
    proc = subprocess.run(
        [*browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path / 'profile'}",
         "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120,
    )
    match = re.search(r"data-check=\"([^\"]+)\"", proc.stdout)
    assert match, proc.stderr[-2000:]
    check = json.loads(match.group(1).replace("&quot;", '"'))
    assert check["images"] == [True], check
    tables = dict(entry.split(":") for entry in check["tables"])
    segments = sum(len(r.verdict.segments) for r in (result.deployed, result.rerun))
    assert tables == {"audit-streams": "2", "audit-segments": str(segments), "audit-tasks": "1"}
