"""Several "hosts" on one machine: network namespaces joined by a veth pair
(:func:`two_hosts`) or by a bridge in a namespace of its own (:func:`bridged_hosts`, for
three or more, with a service address on the bridge that no host's loss takes down).

Only documentation addresses (RFC 5737's 192.0.2.0/24) are used, and only inside the
namespaces; everything made is deleted again, even when a test fails: processes still
running inside a namespace are killed, the namespaces (and with them their veth pairs and
the bridge) and the namespaces' ``/etc/netns/NS/hosts`` files are removed.

Host names, where a test gives them, resolve only inside the namespaces: they are written to
``/etc/netns/NS/hosts`` (iproute2's per-namespace files), which ``ip netns exec NS`` and
:func:`inside` bind-mount over ``/etc/hosts`` in a mount namespace of their own, so this
machine's ``/etc/hosts`` is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

HOST_ADDRESSES = ("192.0.2.1", "192.0.2.2")
SWITCH_ADDRESS = "192.0.2.254"  # the bridge's own address in bridged_hosts' switch namespace
NETNS_ETC = Path("/etc/netns")  # iproute2's per-namespace files (ip-netns(8))
NETNS_RUN = Path("/run/netns")  # where `ip netns add` mounts the namespaces


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
def two_hosts(host_names: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """Yields the names of two namespaces, 192.0.2.1 and 192.0.2.2, joined by a veth pair.

    Args:
        host_names: two names that resolve, inside both namespaces, to 192.0.2.1 and
            192.0.2.2; this machine's hostname then resolves in each namespace to that
            namespace's own address, as a cluster node's hostname does. Empty: no hosts
            files (the namespaces see this machine's ``/etc/hosts``).
    """
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
        if host_names:
            _write_hosts_files(names, host_names)
        yield names
    finally:
        for ns in names:
            _kill_inside(ns)
            _ip("netns", "del", ns)  # deletes the veth end inside it, and so the pair
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        with contextlib.suppress(OSError):
            NETNS_ETC.rmdir()  # only if empty: another test's namespace may still use it
        for veth in veths:  # in case a failure left one outside the namespaces
            if _ip("link", "show", veth).returncode == 0:
                _ip("link", "del", veth)


def host_address(i: int) -> str:
    """The address of host ``i`` (0-based) in :func:`bridged_hosts`: 192.0.2.(i + 1)."""
    return f"192.0.2.{i + 1}"


@contextlib.contextmanager
def bridged_hosts(n: int) -> Iterator[tuple[list[str], str]]:
    """Yields ``(hosts, switch)``: ``n`` namespaces, host ``i`` at :func:`host_address`
    ``(i)``, each joined by a veth pair to a bridge in the namespace ``switch``, which holds
    :data:`SWITCH_ADDRESS` (run a service there, such as etcd, and every host reaches it;
    killing a host's processes leaves it up)."""
    tag = uuid.uuid4().hex[:6]
    hosts = [f"jpg{tag}h{i}" for i in range(n)]
    switch = f"jpg{tag}sw"
    made: list[str] = []
    try:
        for ns in (switch, *hosts):
            _check(_ip("netns", "add", ns))
            made.append(ns)
            _check(_ip("-n", ns, "link", "set", "lo", "up"))
        _check(_ip("-n", switch, "link", "add", "br0", "type", "bridge"))
        _check(_ip("-n", switch, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0"))
        _check(_ip("-n", switch, "link", "set", "br0", "up"))
        for i, ns in enumerate(hosts):
            # made inside the host's namespace, so no veth ever exists in this machine's
            # own; its peer moves to the switch and joins the bridge
            _check(_ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name",
                       f"p{i}"))
            _check(_ip("-n", ns, "link", "set", f"p{i}", "netns", switch))
            _check(_ip("-n", switch, "link", "set", f"p{i}", "master", "br0"))
            _check(_ip("-n", switch, "link", "set", f"p{i}", "up"))
            _check(_ip("-n", ns, "addr", "add", f"{host_address(i)}/24", "dev", "eth0"))
            _check(_ip("-n", ns, "link", "set", "eth0", "up"))
        yield hosts, switch
    finally:
        for ns in made:
            _kill_inside(ns)
        for ns in made:
            _ip("netns", "del", ns)  # deletes the veth pairs and the bridge with it


def inside(ns: str) -> list[str]:
    """The command prefix that runs a program in namespace ``ns``'s network, with its hosts
    file (if any) as ``/etc/hosts``.

    Unlike ``ip netns exec``, which also mounts a fresh ``/sys`` (hiding the cgroup
    hierarchy that slurmd needs), this keeps every other mount: ``nsenter --net`` enters
    the network namespace, ``unshare --mount`` makes a private mount namespace for the
    bind mount; each execs the next, so the program keeps the process id the caller sees.
    """
    run = NETNS_RUN if NETNS_RUN.is_dir() else Path("/var/run/netns")
    enter = ["nsenter", f"--net={run / ns}"]
    hosts = NETNS_ETC / ns / "hosts"
    if not hosts.is_file():
        return enter
    return [*enter, "unshare", "--mount", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
            str(hosts)]


def _write_hosts_files(namespaces: Sequence[str], host_names: Sequence[str]) -> None:
    if len(host_names) != len(HOST_ADDRESSES):
        raise ValueError(f"two host names, not {list(host_names)}")
    nodes = "".join(f"{a} {n}\n" for a, n in zip(HOST_ADDRESSES, host_names))
    for ns, own in zip(namespaces, HOST_ADDRESSES):
        folder = NETNS_ETC / ns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(
            f"127.0.0.1 localhost\n{nodes}{own} {socket.gethostname()}\n")


def _kill_inside(ns: str) -> None:
    """Kills what still runs inside namespace ``ns`` (started by the test), by pid."""
    listed = _ip("netns", "pids", ns)
    for pid in listed.stdout.split() if listed.returncode == 0 else []:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _check(result: subprocess.CompletedProcess) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(result.args)} failed: {result.stderr.strip()}")
