"""Commands in a network namespace of their own that holds only loopback: nothing they send leaves this machine.

Ray opens sockets from C++ (gRPC) and, at every start, its dashboard probes cloud
metadata addresses (docs/integrations.md); the Python socket guard sees neither. The
tests that start Ray therefore run it under `unshare --net` (root, or a kernel that
allows unprivileged user namespaces), with `ip link set lo up` so loopback works.

The namespace holds loopback and nothing else: no other address and no route, so a
connect to any address outside 127.0.0.0/8 and ::1 fails in the kernel at once
(ENETUNREACH) and no packet is sent anywhere, not even onto the namespace's own `lo`.
Headless Chromium (the report's browser test) runs here too: it resolves Google's
hosts and connects to public DNS servers at start, whatever its flags say.
"""

from __future__ import annotations

import functools
import shutil
import subprocess


def command(argv: list[str]) -> list[str]:
    """`argv` run in a fresh network namespace that holds only loopback (brought up)."""
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "netns", *argv]


@functools.cache
def unavailable() -> str | None:
    """Why no namespace can be made here (a skip reason), or None when one can."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare (util-linux) and ip (iproute2) for a loopback-only network namespace"
    try:
        done = subprocess.run(command(["true"]), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run unshare --net ({exc})"
    if done.returncode != 0:
        return ("cannot make a network namespace here (unshare --net: "
                f"{(done.stderr.strip().splitlines() or ['refused'])[-1]}); run as root or allow user namespaces")
    return None
