"""One rank of `fab check --bandwidth`: a short all-reduce through torch.distributed.

Runs ON a node, in the node-ops process itself (op `bandwidth`), one rank
per node, all nodes at once: gloo, or NCCL where every node has a GPU. It
joins the others at rank 0's address and a port chosen free for it, times a
few all-reduces of `size_mb`, then a ring (each rank sends to the next while
receiving from the one before) that times each link on its own, so the
slowest node shows. The process group is destroyed before the reply, and the
op's process exits with it: nothing is left listening or running.

Importing this file needs only the standard library (torch is imported by
`run`), so node ops stay importable on a node without torch.
"""
import os
import sys
import time
from datetime import timedelta

from fabtrain.contract.opreplies import Bandwidth


def run(payload):
    """payload: rank, world_size, master (rank 0's address), port, backend ("gloo" | "nccl"),
    env (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to use), size_mb, iterations, timeout (seconds)."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise RuntimeError("torch is not installed for %s (the bandwidth test runs torch.distributed)"
                           % sys.executable) from None
    os.environ.update({k: str(v) for k, v in (payload.get("env") or {}).items()})
    rank, world = int(payload["rank"]), int(payload["world_size"])
    backend = payload.get("backend", "gloo")
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    host = payload["master"]
    url = "tcp://%s:%d" % ("[%s]" % host if ":" in host else host, int(payload["port"]))
    timeout = timedelta(seconds=float(payload.get("timeout", 30)))
    dist.init_process_group(backend, init_method=url, rank=rank, world_size=world, timeout=timeout)
    try:
        return _measure(torch, dist, device, rank, world, payload)
    finally:
        dist.destroy_process_group()


def _measure(torch, dist, device, rank, world, payload):
    numel = max(1, int(float(payload.get("size_mb", 16)) * (1 << 20)) // 4)
    iterations = max(1, int(payload.get("iterations", 5)))
    data = torch.ones(numel, dtype=torch.float32, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dist.all_reduce(data)  # warm-up: connections and buffers
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(data)
    sync()
    allreduce = (time.perf_counter() - start) / iterations

    link = None
    if world > 1:
        incoming = torch.empty_like(data)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iterations):
            sent = dist.isend(data, (rank + 1) % world)
            dist.recv(incoming, (rank - 1) % world)
            sent.wait()
        sync()
        link = (time.perf_counter() - start) / iterations

    # Every rank's two times, so each reply (rank 0's is read) holds the whole table.
    times = torch.zeros(world, 2, dtype=torch.float64, device=device)
    times[rank, 0] = allreduce
    times[rank, 1] = link or 0.0
    dist.all_reduce(times)
    return Bandwidth(rank=rank, world_size=world, backend=dist.get_backend(), bytes=numel * 4, iterations=iterations,
                     allreduce_s=[float(t) for t in times[:, 0].tolist()],
                     link_s=[float(t) for t in times[:, 1].tolist()] if world > 1 else None,
                     iface=os.environ.get("NCCL_SOCKET_IFNAME" if dist.get_backend() == "nccl"
                                          else "GLOO_SOCKET_IFNAME")).wire()
