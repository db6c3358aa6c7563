"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Only the documentation addresses 192.0.2.1 and 192.0.2.2 (RFC 5737) are used, and only
inside the namespaces; everything made is deleted again, even when a test fails.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

HOST_ADDRESSES = ("192.0.2.1", "192.0.2.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def why_no_namespaces() -> str | None:
    """Why two namespaces cannot be made here, or None if they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root or in a privileged container)"
    name = f"jpgprobe{uuid.uuid4().hex[:8]}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name)
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, str]]:
    """Yields the names of two namespaces, 192.0.2.1 and 192.0.2.2, joined by a veth pair."""
    tag = uuid.uuid4().hex[:6]
    names = (f"jpg{tag}h0", f"jpg{tag}h1")
    veths = (f"jv{tag}a", f"jv{tag}b")
    try:
        for ns in names:
            _check(_ip("netns", "add", ns))
        _check(_ip("link", "add", veths[0], "type", "veth", "peer", "name", veths[1]))
        for ns, veth, addr in zip(names, veths, HOST_ADDRESSES):
            _check(_ip("link", "set", veth, "netns", ns))
            _check(_ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth))
            _check(_ip("-n", ns, "link", "set", veth, "up"))
            _check(_ip("-n", ns, "link", "set", "lo", "up"))
        yield names
    finally:
        for ns in names:
            _ip("netns", "del", ns)  # deletes the veth end inside it, and so the pair
        for veth in veths:  # in case a failure left one outside the namespaces
            if _ip("link", "show", veth).returncode == 0:
                _ip("link", "del", veth)


def _check(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(result.args)} failed: {result.stderr.strip()}")
