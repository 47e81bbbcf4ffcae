"""The Ray executor: a sweep's batches on Ray actors, each loading the model once and keeping it.

`kvevict ab ... --executor ray [--address ADDR] [--workers N]`. Without an address a
local Ray instance is started for the run and stopped after it (a Ray instance already
started in this process, e.g. by a library user or a test, is used and left running).
The local instance stays on this machine: every Ray process binds to 127.0.0.1, and
Ray's usage statistics are off unless the user set `RAY_USAGE_STATS_ENABLED`
(`loopback_start`; docs/integrations.md says what Ray does at start). An address the
user gives is theirs: kvevict only checks that a Ray server answers there.
Each of `workers` actors holds a `worker.Worker`; the driver hands a batch to each idle
actor, waits for whichever finishes first, appends its records (the driver alone
writes `results.jsonl`) and hands that actor the next batch.

A worker that dies mid-batch (killed, out of memory, node lost) loses only that batch:
Ray restarts the actor and the driver hands the batch out again, up to `retries` more
times; then the batch is listed in `failed` and the sweep goes on. An error raised by
the batch itself (a bad model name, a bug) is not retried: a `KvevictError` stops the
sweep with its one line, anything else marks the batch failed.

Ray is an optional extra (`pip install kvevict[ray]`), imported only here.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from ..ab.executors import Executor, WorkerSpec
from ..ab.worker import Batch
from ..errors import KvevictError

#: seconds to reach a Ray address before giving up with a clear error (no hang)
CONNECT_TIMEOUT = 10.0
INSTALL = "pip install kvevict[ray]"
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
HTTP2_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # an empty SETTINGS frame: length 0, type 4, stream 0
LOOPBACK = "127.0.0.1"
#: Ray's switch for usage statistics (ray/_common/usage/usage_lib.py, Ray 2.60): "0" off, "1" on
USAGE_STATS = "RAY_USAGE_STATS_ENABLED"
#: read by Ray at import (ray/_private/ray_constants.py, `ENABLE_RAY_CLUSTER`); "0" makes
#: `services.get_node_ip_address` answer 127.0.0.1 instead of the address of the interface that routes outside
LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def import_ray():
    """The `ray` module, or one line naming the install."""
    try:
        import ray
    except ImportError:
        raise KvevictError(f"--executor ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def check_reachable(address: str, timeout: float | None = None) -> None:
    """Check that a Ray server answers at ADDR (`host:port` or `ray://host:port`) within `timeout` seconds
    (default `CONNECT_TIMEOUT`).

    `ray.init` against an address nobody answers retries for minutes; this turns that
    into one line naming the fix. `auto` (the cluster this machine belongs to) is left to Ray.
    """
    timeout = CONNECT_TIMEOUT if timeout is None else timeout
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise KvevictError(f"--address '{address}' is not HOST:PORT or ray://HOST:PORT: give the head node's address "
                           "(e.g. 10.0.0.5:6379), or leave it out to start a local Ray instance")
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            # Ray's GCS and its client server speak gRPC: a live one answers the HTTP/2 preface with a
            # SETTINGS frame. A port that merely accepts connections (a proxy, another service) does not.
            conn.sendall(HTTP2_PREFACE + HTTP2_SETTINGS)
            answer = conn.recv(9)
        if len(answer) < 9 or answer[3] != 0x04:
            raise ConnectionError(0, "no gRPC server answered")
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or str(exc))
        raise KvevictError(f"cannot reach Ray at '{address}' ({reason} after at most {timeout:g} s): start the "
                           "cluster (`ray start --head`) and pass its address, or leave --address out to start "
                           "a local Ray instance") from None


@contextmanager
def loopback_start(ray) -> Iterator[None]:
    """While a local Ray instance starts: every process it spawns binds to 127.0.0.1, and
    usage statistics are off unless the user set `RAY_USAGE_STATS_ENABLED` themselves
    (Ray 2.60's `ray.init` also switches them off for a cluster it starts, except on
    nightly builds, where it asks; kvevict does not rely on that).

    Ray 2.60 resolves `_node_ip_address="127.0.0.1"` to the address of the interface that
    routes outside (`services.resolve_ip_for_localhost`), so the address alone does not
    keep a local instance on loopback. What does is Ray's own switch for machines where a
    Ray cluster is not supported: with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
    `get_node_ip_address` answers 127.0.0.1; the GCS, the raylet, the dashboard process
    and the workers then listen on 127.0.0.1 only, and Ray skips its probe of outside DNS
    servers for the local address. Ray reads the variable once, at import, so its
    constant is switched here as well, and both are put back once the instance is up
    (the processes it spawned keep what they inherited).
    """
    from ray._private import ray_constants

    saved = {name: os.environ.get(name) for name in (LOCAL_ONLY, USAGE_STATS)}
    constant = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOCAL_ONLY] = "0"
    os.environ.setdefault(USAGE_STATS, "0")
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = constant
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RayWorker:
    """The body of one Ray actor: a `Worker` that lives as long as the actor (model loaded once)."""

    def __init__(self, spec: WorkerSpec, threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.worker = spec.build()

    def pid(self) -> int:
        return os.getpid()

    def run(self, batch: Batch) -> list[dict]:
        return self.worker.run(batch)


@dataclass
class RayExecutor(Executor):
    """Batches on `workers` Ray actors of `cpus` CPUs each (default: a local instance's cores shared out).
    Each actor builds its own worker from the sweep's `WorkerSpec` (without the driver's model)."""

    address: str | None = None
    workers: int = 2
    retries: int = 2
    cpus: int | None = None
    #: called with (batch, worker pid) each time a batch is handed to a worker: lets a caller watch or fault-test
    on_dispatch: Callable[[Batch, int], None] | None = None
    in_process: bool = False
    _cpus: int | None = field(default=None, init=False, repr=False)  # CPUs per worker, set while the executor is open
    #: the actors of the last `run` and the spec they were built from: a later `run` while the executor is
    #: still open, with the same spec (the next step of a search), reuses them, models loaded
    _pool: tuple | None = field(default=None, init=False, repr=False)

    def _start(self, ray) -> tuple[bool, int]:
        """Connect or start Ray; (whether this run started it, CPUs per worker)."""
        cpus = self.cpus or (1 if self.address else max(1, (os.cpu_count() or 1) // self.workers))
        if ray.is_initialized():
            here = ray.get_runtime_context().gcs_address
            if self.address and self.address not in ("auto", here):
                raise KvevictError(f"this process is already connected to Ray at '{here}', not '{self.address}': "
                                   "leave --address out to use it, or run from a fresh process")
            return False, cpus
        if self.address:
            check_reachable(self.address)
            try:  # a server that answers but is not Ray's (a proxy) makes Ray give up after ~20 s
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:  # ValueError: ray:// without ray[client]
                raise KvevictError(f"cannot reach Ray at '{self.address}' ({exc}): start the cluster (`ray start "
                                   "--head`) and pass its address, or leave --address out to start a local Ray "
                                   "instance") from None
        else:
            # the workers import kvevict from where this process does (a source checkout included)
            path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), _package_root()) if p)
            with loopback_start(ray):
                ray.init(num_cpus=cpus * self.workers, include_dashboard=False, log_to_driver=False,
                         configure_logging=False, _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK,
                         runtime_env={"env_vars": {"PYTHONPATH": path}})
        return True, cpus

    @contextmanager
    def opened(self) -> Iterator[None]:
        """Connect to (or start) Ray for the sweep; a Ray this run started stops with it."""
        ray = import_ray()
        started, self._cpus = self._start(ray)
        try:
            yield
        finally:
            self._cpus, self._pool = None, None  # the actors go with their handles
            if started:
                ray.shutdown()

    def run(self, spec, todo, finished, progress) -> None:
        if self._cpus is None:  # called outside `opened` (a library user)
            with self.opened():
                return self.run(spec, todo, finished, progress)
        self._run(import_ray(), spec.portable(), todo, finished, progress, self._cpus)

    def _run(self, ray, spec: WorkerSpec, todo, finished, progress, cpus: int) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        if self._pool is None or self._pool[0] != spec or len(self._pool[1]) < min(self.workers, len(todo)):
            actor_class = ray.remote(num_cpus=cpus, max_restarts=-1)(RayWorker)
            self._pool = (spec, [actor_class.remote(spec, cpus) for _ in range(min(self.workers, len(todo)))])
        actors = self._pool[1][:len(todo)]
        task = progress.add_task(f"ray: {len(actors)} workers, {len(todo)} batches", total=len(todo))
        queue = list(todo)
        attempts: dict[int, int] = {}
        running: dict = {}  # object ref -> (actor, batch)

        def dispatch(actor) -> None:
            if not queue:
                return
            batch = queue.pop(0)
            attempts[id(batch)] = attempts.get(id(batch), 0) + 1
            if self.on_dispatch is not None:
                self.on_dispatch(batch, _pid(ray, actor))
            running[actor.run.remote(batch)] = (actor, batch)

        for actor in actors:
            dispatch(actor)
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            actor, batch = running.pop(ref)
            try:
                lines = ray.get(ref)
            except RayActorError as exc:  # the worker died: Ray restarts it; hand the batch out again
                if attempts[id(batch)] <= self.retries:
                    queue.insert(0, batch)
                else:
                    self.failed.append((batch, f"worker died {attempts[id(batch)]} times ({type(exc).__name__})"))
                    progress.advance(task)
                dispatch(actor)
                continue
            except RayTaskError as exc:
                if isinstance(exc.cause, KvevictError):
                    raise KvevictError(str(exc.cause)) from None
                self.failed.append((batch, f"{type(exc.cause).__name__}: {exc.cause}"))
                progress.advance(task)
                dispatch(actor)
                continue
            finished(lines)
            progress.advance(task)
            dispatch(actor)
        progress.remove_task(task)


def _pid(ray, actor, patience: float = 60.0) -> int:
    """The process id of `actor`, waiting while Ray restarts it after a death."""
    from ray.exceptions import RayActorError

    deadline = time.monotonic() + patience
    while True:
        try:
            return ray.get(actor.pid.remote())
        except RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _package_root() -> str:
    """The folder that holds the `kvevict` package this module belongs to (`src/` in a checkout)."""
    return str(Path(__file__).resolve().parents[2])
