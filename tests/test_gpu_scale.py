"""`benchmarks/gpu_scale.sh` keeps working where no GPU is: its CPU mode at the smallest sizes.

The script is written for a lent GPU and run there rarely; this runs its `--device cpu` mode (the shapes
divided, a few hundred tokens) with one model, a policy of each kind of stream (chunked, per-head, read
token by token), one compression and the decode steps, and reads back the rows it wrote: every part ran,
each stream has a row at each length, the ratios are measured against its baseline, nothing failed. Then
the run is interrupted after its compression (the decode rows cut from its `--json`) and run again: it
resumes, running the decode part alone and leaving every recorded row as it was.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [192, 256]


def run(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_scale.sh"), "--device", "cpu", "--python", sys.executable,
         "--scale", "32", "--models", "llama-3.1-8b", "--lengths", ",".join(map(str, LENGTHS)), "--budget", "64",
         "--chunk", "32", "--tbt-max", "96", "--policies", "window;h2o;adakv:snapkv;q4:group=32,residual=16+window",
         "--compress-lengths", "160", "--prefill-chunk", "48", "--compress-policies", "expected-attention",
         "--decode-budget", "64", "--decode-steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )


def test_the_gpu_script_runs_on_the_cpu_writes_every_part_and_resumes(tmp_path):
    out = tmp_path / "rows.jsonl"
    proc = run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED" not in proc.stdout, proc.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [r for r in rows if "failed" in r]
    streams = [r for r in rows if r["part"] == "stream"]
    by_policy: dict[str, list[int]] = {}
    for row in streams:
        by_policy.setdefault(row["policy"], []).append(row["tokens"])
        assert row["s_per_1k"] > 0 and row["sdpa_s_per_1k"] > 0
        assert abs(row["ratio"] - row["s_per_1k"] / row["sdpa_s_per_1k"]) < 1e-9
    assert by_policy == {"window": LENGTHS, "h2o": LENGTHS, "adakv:snapkv": LENGTHS,
                         "q4:group=32,residual=16+window": [96]}  # a residual form reads token by token
    compressed = [r for r in rows if r["part"] == "compress"]
    assert [(r["policy"], r["read"]) for r in compressed] == [
        ("snapkv (one forward)", "one forward"), ("expected-attention", "chunks of 48")]
    decode = {r["policy"]: r for r in rows if r["part"] == "decode"}
    assert decode["dynamic"]["ratio"] == 1.0 and len(decode) > 5
    assert all(r["dtype"] == "float32" and r["device"] == "cpu" for r in rows)

    # interrupted before its decode part: a rerun runs that part alone and keeps every other row as it was
    before = [line for line in out.read_text().splitlines() if json.loads(line)["part"] != "decode"]
    out.write_text("".join(line + "\n" for line in before))
    again = run(out)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert lines[: len(before)] == before
    assert [json.loads(line)["part"] for line in lines[len(before):]] == ["decode"] * len(decode)
