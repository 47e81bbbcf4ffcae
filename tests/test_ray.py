"""Sweeps on Ray: the same cells and numbers as a local run, a SIGKILLed worker retried, failures reported and
finished by a rerun, every bad input one line (Ray's absence and unreachable addresses included), and a local Ray
instance that stays on loopback.

Every test that starts Ray runs it in a network namespace of its own that holds only loopback (`netns.py`), under
the socket guard (`guarded.py`): Ray's C++ sockets and its dashboard's metadata probe cannot leave the machine. The
tests that share a Ray instance send their bodies to one Ray host (`guarded.Host`: 2 CPUs, 2 workers, the tiny
model), so Ray starts once for them. They skip, saying why, when the `ray` extra is not installed (`make test`
installs it) or no namespace can be made here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from kvevict.ab import SweepConfig, run_sweep
from kvevict.ab.executors import LocalExecutor

import netns
from guarded import Host
from netguard import is_loopback
from support import cli, cli_error

TESTS = Path(__file__).resolve().parent
SRC = str(TESTS.parent / "src")
needs_ray = pytest.mark.skipif(find_spec("ray") is None, reason="the ray extra is not installed: pip install "
                               "kvevict[ray] (make test installs it)")
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 30
# what a cell measured; timing and memory differ between any two runs and are left out
NUMBERS = ("ppl", "nll_mean", "kl_to_full", "top1_agreement", "sink_loss", "max_kept", "curve", "sink_lost_at",
           "n_predictions", "full_ppl_same_tokens")


def child_env() -> dict:
    """The environment of a process the tests start: this checkout's kvevict and the test modules, one thread."""
    path = os.pathsep.join(p for p in (SRC, str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)


def needs_netns() -> None:
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"Ray runs only in a loopback-only network namespace in the tests: {reason}")


def numbers(path: Path) -> dict:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {d["key"]: {k: d.get(k) for k in NUMBERS} for d in lines}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray-text") / "text.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def ray_host(tmp_path_factory):
    """One local Ray instance, started by kvevict in a loopback-only namespace, for every test that sends it work."""
    if find_spec("ray") is None:
        pytest.skip("the ray extra is not installed: pip install kvevict[ray]")
    needs_netns()
    host = Host(tmp_path_factory.mktemp("ray-host"), child_env())
    yield host
    host.close()


def sweep(tmp_path, tiny_dir, text_file, name: str) -> SweepConfig:
    return SweepConfig(model=str(tiny_dir), text=str(text_file), tokens=240, budgets=[16, 32],
                       policies=["window", "h2o", "sink2+window"], sinks=[0, 4], oracle_stride=20,
                       out=str(tmp_path / "runs"), name=name)


@pytest.fixture(scope="module")
def local_numbers(tmp_path_factory, tiny_dir, text_file) -> dict:
    """The numbers of `sweep` run in this process by the local executor: what every Ray run of it must equal
    (computed once for the module's tests)."""
    folder = tmp_path_factory.mktemp("ray-local")
    run_sweep(sweep(folder, tiny_dir, text_file, "local"), progress=False, executor=LocalExecutor())
    return numbers(folder / "runs" / "local" / "results.jsonl")


def _run(*args: str, namespace: bool = False) -> subprocess.CompletedProcess:
    """`kvevict ARGS` in a fresh process under the socket guard (exit 3 if it refused a socket); with `namespace`,
    inside a loopback-only network namespace of its own."""
    argv = [sys.executable, str(TESTS / "guarded.py"), "cli", *args]
    return subprocess.run(netns.command(argv) if namespace else argv, capture_output=True,
                          text=True, env=child_env(), timeout=600)


def ray_servers() -> set[int]:
    """Process ids of Ray's GCS servers on this machine (one per running Ray instance)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"gcs_server" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return found


@needs_ray
@pytest.mark.ray_cluster
def test_cli_ray_run_equals_local_run_and_resumes(ray_host, tmp_path, tiny_dir, text_file, local_numbers):
    """`--executor ray` without an address starts a local Ray instance for the run and stops it; same cells, same
    numbers as the local executor (the options are `sweep`'s); `kvevict report` redraws it; a rerun has nothing
    left to do. The Ray run is a Ray sweep under the socket guard, in a namespace of its own; the rerun runs the
    same command in the Ray host's process (guarded, in its namespace)."""
    needs_netns()
    common = ["ab", "--model", str(tiny_dir), "--text", str(text_file), "--tokens", "240", "--budgets", "16,32",
              "--policies", "window,h2o,sink2+window", "--sinks", "0,4", "--oracle-stride", "20",
              "--out", str(tmp_path / "runs")]
    before = ray_servers()
    ray_run = _run(*common, "--name", "ray", "--executor", "ray", "--workers", "2", namespace=True)
    assert ray_run.returncode == 0, ray_run.stderr
    deadline = time.monotonic() + 15
    while ray_servers() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_servers() <= before  # the local instance the run started is stopped with it
    ours = numbers(tmp_path / "runs" / "ray" / "results.jsonl")
    assert len(ours) == 1 + 2 * (1 + 3 + 2) and ours == local_numbers  # full; per budget oracle, 3 policies, 2 sinks
    for line in (tmp_path / "runs" / "ray" / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["batch_seconds"] > 0 and record["tokens_per_s"] > 0 and record["peak_mb"] > 0
    (code, err), _ = ray_host.call(rerun_cli, [*common, "--name", "ray", "--executor", "ray"])
    assert code == 0, err
    assert numbers(tmp_path / "runs" / "ray" / "results.jsonl") == ours  # nothing recomputed or appended
    report = cli("report", str(tmp_path / "runs" / "ray"), "--markdown")
    assert report.exit_code == 0 and report.stdout.startswith("## Verdict")


# --- bad input ----------------------------------------------------------------------------------------------


def test_unknown_executor_is_one_line(tmp_path):
    cli_error("ab", "--executor", "dask", "--out", str(tmp_path), needles=("--executor must be one of local, ray",
                                                                           "'dask'"))


def test_address_without_ray_executor_is_one_line(tmp_path):
    cli_error("ab", "--address", "127.0.0.1:6379", "--out", str(tmp_path), needles=("--executor ray",))


def test_missing_ray_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is not installed
    cli_error("ab", "--executor", "ray", "--out", str(tmp_path), needles=("pip install kvevict[ray]",))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _garbage_server(server: socket.socket) -> None:
    """Answer every connection with an HTTP/1.1 error and hang up: a port where something other than Ray listens.
    Returns once the test closes `server`."""
    server.settimeout(0.1)
    while server.fileno() != -1:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        with conn:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@needs_ray
@pytest.mark.parametrize("kind, needle", [
    ("refused", "Connection refused"), ("silent", "timed out"), ("garbage", "no gRPC server answered"),
    ("ray-refused", "Connection refused"), ("ray-garbage", "no gRPC server answered"), ("nohost", "is not HOST:PORT"),
])
def test_unreachable_ray_address_fails_fast_in_one_line(tmp_path, monkeypatch, kind, needle):
    """Each on loopback: a closed port, a port that accepts and never answers (the wait is bounded by the connect
    timeout, 1 s here), a port where something else answers, the same through `ray://`, and no port at all."""
    from kvevict.integrations import ray_executor

    monkeypatch.setattr(ray_executor, "CONNECT_TIMEOUT", 1.0)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        port = server.getsockname()[1]
        if kind.endswith("garbage"):
            threading.Thread(target=_garbage_server, args=(server,), daemon=True).start()
        address = {"refused": f"127.0.0.1:{_closed_port()}", "silent": f"127.0.0.1:{port}",
                   "garbage": f"127.0.0.1:{port}", "ray-refused": f"ray://127.0.0.1:{_closed_port()}",
                   "ray-garbage": f"ray://127.0.0.1:{port}", "nohost": "nohost"}[kind]
        prefix = "is not HOST:PORT" if kind == "nohost" else "cannot reach Ray at"
        cli_error("ab", "--executor", "ray", "--address", address, "--out", str(tmp_path),
                  needles=(prefix, needle, f"'{address}'", "--address"))
        if kind == "silent":
            cli_error("ab", "--executor", "ray", "--address", address, "--out", str(tmp_path),
                      needles=("after at most 1 s",))


class Killer:
    """Kills the worker a chosen batch was handed to, `delay` seconds later (inside the batch): the rows batch of
    each budget in `times`, that many times."""

    def __init__(self, times: dict[int, int], delay: float = 0.3) -> None:
        self.times, self.delay = times, delay
        self.dispatched: list[tuple[str, int]] = []
        self.killed: dict[int, list[int]] = {budget: [] for budget in times}

    def __call__(self, batch, pid: int) -> None:
        self.dispatched.append((batch.name, pid))
        if batch.kind == "rows" and len(self.killed.get(batch.budget, ())) < self.times.get(batch.budget, 0):
            self.killed[batch.budget].append(pid)
            threading.Timer(self.delay, os.kill, (pid, signal.SIGKILL)).start()


# --- bodies the Ray host runs (module-level, so the host imports them by name) ------------------------------------


def killing_sweep(tmp_path, tiny_dir, text_file) -> dict:
    """One sweep, two faults: budget 16's worker is SIGKILLed once (one retry is allowed), budget 32's every time
    it is handed out. The command's exit code, what failed, what was killed and dispatched, what was written."""
    from kvevict.cli.ab import run_ab
    from kvevict.integrations.ray_executor import RayExecutor

    config = sweep(tmp_path, tiny_dir, text_file, "killed")
    killer = Killer({16: 1, 32: 2})
    executor = RayExecutor(workers=2, retries=1, on_dispatch=killer)
    try:
        run_ab(config, executor=executor)
        code = 0
    except BaseException as exc:  # noqa: B036 - typer.Exit(1) after the report is written
        code = getattr(exc, "exit_code", repr(exc))
    results = config.folder / "results.jsonl"
    written = [json.loads(line)["key"] for line in results.read_text().splitlines()]
    return {"code": code, "failed": [(b.name, len(b.cells)) for b, _ in executor.failed], "written": written,
            "report": (config.folder / "report.html").exists(), "killed": killer.killed,
            "dispatched": [n for n, _ in killer.dispatched]}


def rerun_cli(args: list[str]) -> tuple[int, str]:
    """`kvevict ARGS` in the host's process: its exit code and stderr."""
    result = cli(*args)
    return result.exit_code, result.stderr


def rerun_sweep(tmp_path, tiny_dir, text_file, name: str) -> None:
    from kvevict.integrations.ray_executor import RayExecutor

    run_sweep(sweep(tmp_path, tiny_dir, text_file, name), progress=False, executor=RayExecutor(workers=2))


def where_ray_listens() -> dict:
    """The address Ray reports for its GCS, and every TCP port listening in this network namespace (the host's own:
    only Ray listens there), as (address, port) from /proc/net/tcp and tcp6."""
    import ray

    listening = []
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state != "0A":  # LISTEN
                continue
            hexaddr, hexport = local.split(":")
            raw = bytes.fromhex(hexaddr)
            if table == "tcp":
                host = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            listening.append((host, int(hexport, 16)))
    from ray._private import worker

    node = worker._global_node
    usage = {}  # each process Ray started: its usage-statistics switch
    for kind, infos in node.all_processes.items():
        for info in infos:
            environ = Path(f"/proc/{info.process.pid}/environ").read_bytes().split(b"\0")
            usage[kind] = next((v.split(b"=", 1)[1].decode() for v in environ
                                if v.startswith(b"RAY_USAGE_STATS_ENABLED=")), None)
    return {"gcs": ray.get_runtime_context().gcs_address, "node": ray.util.get_node_ip_address(),
            "listening": listening, "usage": usage}


# --- the tests that share the Ray host ------------------------------------------------------------------------------


@needs_ray
@pytest.mark.ray_cluster
def test_a_local_ray_instance_binds_to_loopback_only_with_usage_statistics_off(ray_host):
    """Every process of kvevict's local instance listens on loopback and has Ray's usage statistics switched off
    (the test environment does not set the switch). The host's namespace holds only loopback, so Ray could bind
    nowhere else there: what makes Ray choose 127.0.0.1 on a machine with a routable interface is checked, without
    one, by `test_loopback_start_answers_loopback_without_asking_the_network`."""
    found, _ = ray_host.call(where_ray_listens)
    assert found["gcs"].rsplit(":", 1)[0] == "127.0.0.1" and found["node"] == "127.0.0.1", found
    assert found["listening"] and all(is_loopback(host) for host, _ in found["listening"]), found
    assert {"gcs_server", "raylet", "dashboard"} <= set(found["usage"]), found["usage"]
    assert set(found["usage"].values()) == {"0"}, found["usage"]  # usage statistics off in every Ray process


@needs_ray
def test_loopback_start_answers_loopback_without_asking_the_network(monkeypatch):
    """Left to itself Ray finds its node address by a UDP connect towards a public DNS server (the route out of
    the machine), and binds there. Inside `loopback_start` it must answer 127.0.0.1 without that connect (the
    socket guard fails this test if it is made), and afterwards the switch and the environment are as before."""
    import ray
    from ray._private import ray_constants, services

    from kvevict.integrations.ray_executor import LOCAL_ONLY, USAGE_STATS, loopback_start

    monkeypatch.delenv(LOCAL_ONLY, raising=False)
    monkeypatch.delenv(USAGE_STATS, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with loopback_start(ray):
        assert services.get_node_ip_address() == "127.0.0.1"
        assert os.environ[LOCAL_ONLY] == "0" and os.environ[USAGE_STATS] == "0"
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    assert LOCAL_ONLY not in os.environ and USAGE_STATS not in os.environ


@needs_ray
@pytest.mark.ray_cluster
def test_a_sigkilled_worker_loses_only_its_batch_and_one_dying_every_time_is_reported_and_rerun(
        ray_host, tmp_path, tiny_dir, text_file, local_numbers):
    """Budget 16's batch is retried once its worker is killed and then written whole; budget 32's, killed every
    time, is reported failed (exit 1, the report still written, nothing of it in the results), and a rerun of the
    same sweep finishes it: the numbers are then the local executor's."""
    got, err = ray_host.call(killing_sweep, tmp_path, tiny_dir, text_file)
    assert len(got["killed"][16]) == 1 and len(got["killed"][32]) == 2
    assert got["dispatched"].count("budget 16: rows") == 2  # handed out again once
    assert got["dispatched"].count("budget 32: rows") == 2  # and given up after its one retry
    assert got["code"] == 1
    assert got["failed"] == [("budget 32: rows", 5)]
    assert "failed: budget 32: rows (window, h2o, sink2+window, window, sink4+window)" in err
    assert "rerun the same command to finish it" in err
    assert not any("|32" in key and "oracle" not in key for key in got["written"])
    assert sum("|16" in key and "oracle" not in key for key in got["written"]) == 5  # the retried batch, whole
    assert got["report"]
    ray_host.call(rerun_sweep, tmp_path, tiny_dir, text_file, "killed")  # the rerun
    assert numbers(tmp_path / "runs" / "killed" / "results.jsonl") == local_numbers


def test_core_runs_without_the_extras(tmp_path, tiny_dir):
    """With `ray` and `lm_eval` unimportable, kvevict imports, runs a local sweep, and names each install."""
    script = f"""
import sys
sys.modules["ray"] = None
sys.modules["lm_eval"] = None
import kvevict, kvevict.ab, kvevict.cli, kvevict.integrations.lmeval
from typer.testing import CliRunner
from kvevict.cli import app
run = CliRunner().invoke(app, ["ab", "--model", {str(tiny_dir)!r}, "--text", {str(Path(__file__))!r},
                               "--tokens", "80", "--budgets", "16", "--policies", "window", "--oracle-stride", "40",
                               "--out", {str(tmp_path)!r}, "--name", "core"])
assert run.exit_code == 0, run.output
for args in (["ab", "--executor", "ray", "--out", {str(tmp_path)!r}], ["lm-eval", "--tasks", "copa"]):
    run = CliRunner().invoke(app, args)
    print(run.exit_code, run.stderr.strip())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    ray_line, lm_line = done.stdout.strip().splitlines()[-2:]
    assert ray_line == "2 error: --executor ray needs Ray, which is not installed: pip install kvevict[ray]"
    assert lm_line == ("2 error: kvevict lm-eval needs lm-evaluation-harness, which is not installed: "
                       "pip install kvevict[lm-eval]")
    assert (tmp_path / "core" / "results.jsonl").exists()
