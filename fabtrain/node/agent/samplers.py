"""What the agent measures besides processes: the host (CPU, load, memory, swap, disk,
network, from /proc), NVIDIA GPUs (through NVML, only where a driver is present), and
the TCP send backlog of a job's ranks (the communication straggler's signal).

Standard library only; nvidia-ml-py is imported lazily, only where a driver
is present, so the node side needs nothing installed.
"""
from __future__ import annotations

import os
import socket
import struct
import time


class HostSampler:
    """Host CPU, load, memory, swap, disk and network, as rates between two samples."""

    def __init__(self, disk_path: str):
        self.disk_path = disk_path
        self._cpu = self._read_cpu()
        self._net = self._read_net()
        self._t = time.monotonic()

    @staticmethod
    def _read_cpu():
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields[:8]), idle

    @staticmethod
    def _read_net():
        rx = tx = 0
        try:
            with open("/proc/net/dev") as f:
                for line in f.readlines()[2:]:
                    name, _, data = line.partition(":")
                    if name.strip() == "lo":
                        continue
                    v = data.split()
                    rx += int(v[0])
                    tx += int(v[8])
        except (OSError, ValueError, IndexError):
            return None
        return rx, tx

    @staticmethod
    def _meminfo() -> dict[str, int]:
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    k, _, v = line.partition(":")
                    parts = v.split()
                    if parts:
                        info[k] = int(parts[0]) * 1024
        except (OSError, ValueError):
            pass
        return info

    def sample(self) -> dict:
        now = time.monotonic()
        dt = max(1e-6, now - self._t)
        cpu, net = self._read_cpu(), self._read_net()
        out: dict = {}
        if cpu and self._cpu and cpu[0] > self._cpu[0]:
            total, idle = cpu[0] - self._cpu[0], cpu[1] - self._cpu[1]
            out["cpu_percent"] = round(100.0 * (total - idle) / total, 1)
        else:
            out["cpu_percent"] = 0.0
        try:
            out["load"] = [round(x, 2) for x in os.getloadavg()]
        except OSError:
            out["load"] = None
        m = self._meminfo()
        total = m.get("MemTotal", 0)
        avail = m.get("MemAvailable", m.get("MemFree", 0))
        out["mem_total"] = total
        out["mem_used"] = total - avail
        out["mem_percent"] = round(100.0 * (total - avail) / total, 1) if total else None
        swap_total = m.get("SwapTotal", 0)
        out["swap_percent"] = round(100.0 * (swap_total - m.get("SwapFree", 0)) / swap_total, 1) if swap_total else 0.0
        try:
            st = os.statvfs(self.disk_path)  # shutil.disk_usage's arithmetic, without importing shutil
            total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
            out.update(disk_free=free, disk_total=total,
                       disk_percent=round(100.0 * (total - free) / total, 1) if total else None)
        except OSError:
            out.update(disk_free=None, disk_total=None, disk_percent=None)
        if net and self._net:
            out["net_rx_bps"] = round(max(0, net[0] - self._net[0]) / dt, 1)
            out["net_tx_bps"] = round(max(0, net[1] - self._net[1]) / dt, 1)
        else:
            out["net_rx_bps"] = out["net_tx_bps"] = None
        self._cpu, self._net, self._t = cpu, net, now
        return out


class GpuSampler:
    """NVIDIA GPUs through NVML (nvidia-ml-py), only where a driver is present.

    Without a driver, or without the package, `sample()` returns [] and
    `error` says why (once); the agent runs the same either way.
    """

    def __init__(self):
        self.nvml = None
        self.handles = []
        self.error = None
        if not (os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")):
            self.error = "no NVIDIA driver"
            return
        try:
            import pynvml  # nvidia-ml-py
            pynvml.nvmlInit()
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            self.nvml = pynvml
        except ImportError:
            self.error = "nvidia-ml-py not installed"
        except Exception as e:  # NVMLError_*: driver/library mismatch, no permission
            self.error = "NVML: %s" % e

    def sample(self) -> list[dict]:
        if self.nvml is None:
            return []
        n = self.nvml
        out = []
        for i, h in enumerate(self.handles):
            g: dict = {"index": i}
            for key, fn in (("name", lambda: n.nvmlDeviceGetName(h)),
                            ("util", lambda: n.nvmlDeviceGetUtilizationRates(h).gpu),
                            ("mem", lambda: n.nvmlDeviceGetMemoryInfo(h)),
                            ("temp", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                            ("power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0)):
                try:
                    value = fn()
                except Exception:
                    value = None
                if key == "mem":
                    g["mem_used"] = getattr(value, "used", None)
                    g["mem_total"] = getattr(value, "total", None)
                elif key == "name" and isinstance(value, bytes):
                    g["name"] = value.decode()
                else:
                    g[key] = value
            out.append(g)
        return out

    def pids(self) -> dict[int, int]:
        """GPU memory used per pid (compute processes), where NVML can tell."""
        if self.nvml is None:
            return {}
        used: dict[int, int] = {}
        for h in self.handles:
            try:
                for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(h):
                    used[p.pid] = used.get(p.pid, 0) + (p.usedGpuMemory or 0)
            except Exception:
                pass
        return used


# -- the TCP queues of given processes: is a rank's link keeping up with what it sends, does it read what it gets? --

NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, NLMSG_ERROR, NLMSG_DONE = 4, 20, 2, 3
NLM_F_DUMP_REQUEST = 0x301  # NLM_F_REQUEST | NLM_F_DUMP
TCP_ESTABLISHED = 1


def socket_inodes(pid: int) -> set | None:
    """The inodes of the sockets among a process's open files (its /proc/<pid>/fd links ``socket:[N]``), or
    None where they cannot be read (it is gone)."""
    base = "/proc/%d/fd" % pid
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    out = set()
    for fd in fds:
        try:
            link = os.readlink(base + "/" + fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def _netns(pid) -> int | None:
    try:
        return os.stat("/proc/%s/ns/net" % pid).st_ino
    except OSError:
        return None


def diag_tcp_queues() -> dict:
    """{socket inode: (send backlog, bytes received and not yet read)} of every established TCP socket (IPv4 and
    IPv6) of this process's network namespace, through the kernel's sock_diag netlink interface (what `ss`
    reads): a fraction of the cost of parsing /proc/net/tcp. OSError where the kernel does not answer."""
    out = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as s:
            s.settimeout(1.0)
            # inet_diag_req_v2: family, protocol, extensions, pad, the states wanted; an empty inet_diag_sockid
            req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 1 << TCP_ESTABLISHED) + bytes(48)
            s.send(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_DUMP_REQUEST, 1, 0) + req)
            done = False
            while not done:
                data = s.recv(1 << 16)
                if not data:
                    break
                off = 0
                while off + 16 <= len(data):
                    length, kind = struct.unpack_from("=IH", data, off)
                    if kind == NLMSG_DONE:
                        done = True
                        break
                    if kind == NLMSG_ERROR:
                        raise OSError("sock_diag: %d" % struct.unpack_from("=i", data, off + 16)[0])
                    # inet_diag_msg after the header: family, state, timer, retrans, sockid (48 bytes),
                    # expires, rqueue (received, not read), wqueue (write_seq - snd_una), uid, inode
                    if length >= 16 + 72:
                        rqueue, wqueue, _, inode = struct.unpack_from("=IIII", data, off + 16 + 56)
                        out[inode] = (wqueue, rqueue)
                    if length < 16:
                        break
                    off += (length + 3) & ~3
    return out


def proc_tcp_queues(pid: int) -> dict:
    """{socket inode: (send backlog, bytes received and not yet read)} of the established TCP sockets of `pid`'s
    network namespace, from /proc/<pid>/net/tcp and tcp6 (its ``tx_queue:rx_queue``): for a process in another
    namespace than the agent's."""
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            with open("/proc/%d/net/%s" % (pid, name)) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            v = line.split()
            try:
                if len(v) > 9 and int(v[3], 16) == TCP_ESTABLISHED:
                    tx, rx = v[4].split(":")
                    out[int(v[9])] = (int(tx, 16), int(rx, 16))
            except ValueError:
                continue
    return out


class TcpQueues:
    """Each given process's TCP send backlog: the bytes its established TCP sockets hold written but not yet
    acknowledged by the peer (the kernel's write_seq - snd_una: waiting in the socket, in the queueing
    discipline, or in flight). A link slower than what the rank sends keeps it filled through the whole
    collective; one that keeps up drains it in moments. And the bytes they hold received and not yet read by
    the process: a rank busy elsewhere leaves what its neighbour sends it unread; one that waits for it in a
    collective reads it as it comes. One table of the namespace's sockets a sample
    (sock_diag where the process shares the agent's network namespace, else its /proc/<pid>/net/tcp), and
    each process's open files for which sockets are its own."""

    def __init__(self):
        self.own_ns = _netns("self")
        self.netlink = True  # until the kernel refuses sock_diag once

    def _table(self, pid: int, ns) -> dict:
        if self.netlink and ns is not None and ns == self.own_ns:
            try:
                return diag_tcp_queues()
            except (OSError, struct.error):  # no sock_diag here, or an answer it cannot read: /proc from now on
                self.netlink = False
        return proc_tcp_queues(pid)

    def sample(self, pids) -> dict:
        """{pid: (bytes of send backlog, bytes received and unread) over its sockets} for every pid whose open
        files could be read."""
        tables: dict = {}
        out = {}
        for pid in pids:
            inodes = socket_inodes(pid)
            if inodes is None:
                continue
            if not inodes:
                out[pid] = (0, 0)
                continue
            ns = _netns(pid)
            if ns not in tables:
                tables[ns] = self._table(pid, ns)
            table = tables[ns]
            queues = [table[i] for i in inodes if i in table]
            out[pid] = (sum(q[0] for q in queues), sum(q[1] for q in queues))
        return out
