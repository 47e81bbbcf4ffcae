"""`kvevict ruler` and `kvevict envelope --tasks` with `--executor ray`: the samples answered on Ray workers store
the records a local run stores, and a rerun answers nothing again.

The commands run in the Ray host of test_ray.py (one local Ray instance started by kvevict in a loopback-only
network namespace, under the socket guard; `guarded.Host`), the local runs in this process. Marker ray_cluster:
`make test-ray`, not `make test`.
"""

from __future__ import annotations

import pytest

from test_grid_shards import answers
from test_ray import needs_netns, needs_ray, ray_host, rerun_cli  # noqa: F401 - ray_host is a fixture

from support import cli


def ruler_args(tiny_dir, out, name: str) -> list[str]:
    return ["ruler", "--model", str(tiny_dir), "--tasks", "niah_single_1,niah_multikey_1", "--lengths", "400",
            "--samples", "3", "--policies", "window,h2o", "--budgets", "50%,25%", "--out", str(out), "--name", name]


def envelope_args(tiny_dir, out, name: str) -> list[str]:
    return ["envelope", "--model", str(tiny_dir), "--tasks", "niah_single_1", "--lengths", "400", "--policies",
            "window,h2o", "--floor", "16", "--resolution", "2", "--samples-start", "2", "--samples-max", "4",
            "--max-accuracy-drop", "0.6", "--out", str(out), "--name", name]


@needs_ray
@pytest.mark.ray_cluster
@pytest.mark.parametrize("command", [ruler_args, envelope_args])
def test_on_ray_workers_the_records_are_a_local_runs_and_a_rerun_adds_none(ray_host, tmp_path, tiny_dir,  # noqa: F811
                                                                            command):
    needs_netns()
    local = cli(*command(tiny_dir, tmp_path, "local"))
    assert local.exit_code == 0, local.stderr
    ray = [*command(tiny_dir, tmp_path, "ray"), "--executor", "ray", "--workers", "2"]
    (code, err), _ = ray_host.call(rerun_cli, ray)
    assert code == 0, err
    expected = answers(tmp_path / "local" / "results.jsonl")
    results = tmp_path / "ray" / "results.jsonl"
    assert expected and answers(results) == expected
    before = results.read_text()
    (code, err), _ = ray_host.call(rerun_cli, ray)
    assert code == 0, err
    assert results.read_text() == before
