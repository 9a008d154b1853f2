"""Bringing the processes of a job together into one gloo process group.

Parameter-server mode: pserver 0 hosts a TCPStore on --port; every process
(pservers and trainers) connects to it, announces itself, and waits until all
P + T have arrived, for up to --startup_timeout seconds (pservers usually
start well before their trainers). Only then does init_process_group run,
with the job's own --timeout (default 60 s), which bounds every later message:
a peer that dies or hangs fails the job within that time, never torch's
default of 30 minutes.
"""
import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist


class StartupFailed(Exception):
    """The job could not be assembled (a port in use, a peer that never came)."""


def choose_gloo_interface(peer_host):
    """Make gloo advertise an address the peers can reach.

    gloo binds to the address the hostname resolves to, which on many
    machines is 127.0.1.1 (unreachable from the others). Unless
    GLOO_SOCKET_IFNAME is set, pick the interface that routes to `peer_host`.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        import psutil
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer_host, 9))      # no packet is sent; this only asks the routing table
            local = s.getsockname()[0]
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == local for a in addrs):
                os.environ["GLOO_SOCKET_IFNAME"] = name
                return
        if local.startswith("127."):
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    except (ImportError, OSError):
        pass   # keep gloo's default


def join_job(host, port, rank, world_size, describe, startup_timeout, timeout):
    """Join the world of `world_size` processes whose store is at host:port (rank 0 hosts it).

    describe(rank) names a rank in messages ("pserver 1", "trainer 0").
    Returns the store, which stays usable for small agreements.
    """
    choose_gloo_interface(host)
    is_host = rank == 0
    deadline = time.monotonic() + startup_timeout
    if not is_host:
        wait_until_listening(host, port, deadline, lambda: f"{describe(0)} at {host}:{port}", startup_timeout)
    try:
        store = dist.TCPStore(host, port, None, is_host, timeout=timedelta(seconds=startup_timeout),
                              wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if is_host:
            raise StartupFailed(f"cannot listen on port {port}: {first_line(e)}") from None
        raise StartupFailed(f"cannot reach {describe(0)} at {host}:{port} within {startup_timeout:g} s") from None
    store.set(f"joined/{rank}", "1")
    joined = store.add("joined", 1)
    while joined < world_size:
        if time.monotonic() > deadline:
            missing = [describe(r) for r in range(world_size) if not store.check([f"joined/{r}"])]
            raise StartupFailed(f"{', '.join(missing)} did not join within {startup_timeout:g} s")
        time.sleep(0.05)
        joined = store.add("joined", 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    return store


def wait_until_listening(host, port, deadline, what, startup_timeout):
    """Wait for the store's port to accept connections. TCPStore would retry by itself, but it logs
    every failed attempt with a C++ stack trace: a peer that starts later is normal, not an error."""
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise StartupFailed(f"cannot reach {what()} within {startup_timeout:g} s") from None
            time.sleep(0.2)


def first_line(error):
    return str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
