"""Which address gloo binds and advertises to the other processes (CPU collectives).

XLA's gloo collectives open one TCP "device" per process and tell their peers, through the
coordination service, the address it listens on. Left alone, gloo takes the address of this
machine's hostname. On many machines (and containers) the hostname resolves to 127.0.0.1, so a
process on another host is told to connect to its own loopback and every rank times out in
``tcp/pair.cc``. :func:`choose_gloo_device` picks, like torch's gloo backend:

1. ``GLOO_SOCKET_IFNAME`` if set: that interface (torch accepts a comma-separated list and
   uses them all; XLA's gloo takes one, so the first is used);
2. else the hostname's address, if it resolves and is not a loopback address;
3. else the local address of the route to the coordinator (``MASTER_ADDR``): the address
   of the interface the coordinator is reached through.

:func:`install` makes JAX's CPU client use the choice (it re-registers JAX's ``cpu``
backend factory with ``make_gloo_tcp_collectives(hostname=..., interface=...)``); call it
after ``jax.distributed.initialize`` and before the CPU backend starts. GPU and TPU
backends do not use gloo: NCCL reads ``NCCL_SOCKET_IFNAME`` and friends itself, and
``jaxpg-run`` passes them through untouched.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
from collections.abc import Mapping

__all__ = ["GlooDevice", "choose_gloo_device", "install"]


@dataclasses.dataclass(frozen=True)
class GlooDevice:
    """Where gloo listens: an interface name or a host address (one of them), and why."""

    interface: str | None = None
    hostname: str | None = None
    reason: str = ""


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _hostname_address() -> str | None:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None


def route_source_address(destination: str) -> str | None:
    """The local address this machine sends from to reach ``destination`` (no packet sent)."""
    try:
        infos = socket.getaddrinfo(destination, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)  # UDP: only picks the route
                return sock.getsockname()[0]
        except OSError:
            continue
    return None


def choose_gloo_device(
    master_addr: str | None, environ: Mapping[str, str] | None = None
) -> GlooDevice:
    """Chooses gloo's interface or address (see the module docstring).

    Args:
        master_addr: the coordinator's host (``MASTER_ADDR``); ``None`` if unknown.
        environ: the environment to read ``GLOO_SOCKET_IFNAME`` from (default ``os.environ``).

    Raises:
        ValueError: if ``GLOO_SOCKET_IFNAME`` names an interface this machine does not have.
    """
    environ = os.environ if environ is None else environ
    names = [n.strip() for n in environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n.strip()]
    if names:
        known = {name for _, name in socket.if_nameindex()}
        if names[0] not in known:
            raise ValueError(
                f"GLOO_SOCKET_IFNAME={environ['GLOO_SOCKET_IFNAME']!r}: this machine has no "
                f"interface {names[0]!r}; it has {sorted(known)}. Set it to the interface "
                "that reaches the other hosts, or unset it."
            )
        return GlooDevice(interface=names[0], reason="GLOO_SOCKET_IFNAME")
    own = _hostname_address()
    if own is not None and not _is_loopback(own):
        return GlooDevice(hostname=own, reason=f"the hostname's address {own}")
    if master_addr:
        source = route_source_address(master_addr)
        if source is not None:
            return GlooDevice(
                hostname=source, reason=f"the local address of the route to {master_addr}"
            )
    return GlooDevice(reason="gloo's default (the hostname)")


_chosen: GlooDevice | None = None


def _cpu_client_factory():
    """JAX's CPU client factory, with gloo on the chosen device."""
    from jaxpg import _jax_compat

    state = _jax_compat.distributed_state()
    device = _chosen
    if (
        device is None
        or state.client is None
        or _jax_compat.cpu_collectives_implementation() != "gloo"
        or (device.interface is None and device.hostname is None)
    ):
        return _jax_compat.make_cpu_client()
    collectives = _jax_compat.make_gloo_tcp_collectives(
        distributed_client=state.client, hostname=device.hostname, interface=device.interface
    )
    return _jax_compat.make_cpu_client(collectives=collectives)


def install(device: GlooDevice) -> None:
    """Makes JAX's CPU backend, when it starts, run gloo on ``device``.

    Must run before the CPU backend is initialized (``jax.devices()``, any computation).
    """
    global _chosen
    from jaxpg import _jax_compat

    _chosen = device
    if _jax_compat.cpu_backend_factory() is _cpu_client_factory:
        return
    _jax_compat.register_cpu_backend_factory(_cpu_client_factory)
