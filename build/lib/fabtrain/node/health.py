"""What the node agent measures: processes and host health, read from /proc.

Standard library only (plus nvidia-ml-py, imported only where an NVIDIA driver
is present), so the agent stays small: psutil would do the same work with more
memory and an import the nodes may not have.
"""
from __future__ import annotations

import os
import shutil
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def _boot_time() -> float:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


BOOT_TIME = _boot_time()

STATE_NAMES = {"R": "running", "S": "sleeping", "D": "sleeping", "I": "sleeping", "W": "sleeping",
               "T": "stopped", "t": "stopped", "Z": "zombie", "X": "zombie"}


class Proc:
    """One line of /proc/<pid>/stat, the fields the agent uses."""

    __slots__ = ("pid", "state", "ppid", "pgid", "sid", "cpu", "create_time", "rss")

    def __init__(self, pid, state, ppid, pgid, sid, cpu, create_time, rss):
        self.pid, self.state, self.ppid, self.pgid, self.sid = pid, state, ppid, pgid, sid
        self.cpu, self.create_time, self.rss = cpu, create_time, rss

    @property
    def dead(self) -> bool:
        # A zombie holds no memory, port or GPU. One whose parent is PID 1 is
        # as good as reaped (PID 1 reaps lazily in containers).
        return self.state in ("Z", "X")


def read_proc(pid: int) -> Proc | None:
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return None
    try:
        rest = data[data.rindex(b")") + 2:].split()  # the command name may hold spaces and ')'
        return Proc(pid, rest[0].decode(), int(rest[1]), int(rest[2]), int(rest[3]),
                    (int(rest[11]) + int(rest[12])) / CLK_TCK, BOOT_TIME + int(rest[19]) / CLK_TCK,
                    int(rest[21]) * PAGE_SIZE)
    except (ValueError, IndexError):
        return None


def scan() -> dict[int, Proc]:
    """Every process on the machine, by pid."""
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            p = read_proc(int(name))
            if p is not None:
                procs[p.pid] = p
    return procs


class ProcTable:
    """/proc, read cheaply once a second.

    Reading every /proc/<pid>/stat costs ~20 µs a process, every tick, on a
    busy machine most of the agent's CPU. Instead: list /proc (new pids are
    read once, gone ones dropped) and re-read only the `hot` pids the agent
    cares about (its job's processes and their families); the others keep the
    ppid/pgid they were born with, which is all the agent asks of them (a
    process can join a job's process group or family only by being forked
    into it: then it is new). Every `full_every` refreshes, everything is
    re-read, in case a pid was reused between two listings.
    """

    def __init__(self, full_every: int = 10):
        self.procs: dict[int, Proc] = {}
        self.full_every = full_every
        self.count = 0

    def refresh(self, hot=()) -> tuple[dict[int, Proc], set[int]]:
        """(every process by pid, the pids read for the first time)."""
        full = self.count % self.full_every == 0
        self.count += 1
        now = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        for pid in [p for p in self.procs if p not in now]:
            del self.procs[pid]
        new = now - self.procs.keys()
        for pid in (now if full else new | (set(hot) & now)):
            p = read_proc(pid)
            if p is None:
                self.procs.pop(pid, None)
            else:
                self.procs[pid] = p
        return self.procs, new


def environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    return dict(kv.split(b"=", 1) for kv in data.split(b"\0") if b"=" in kv)


def cmdline(pid: int) -> list[str]:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0")[:-1]]
    except OSError:
        return []


def children_map(procs: dict[int, Proc]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in procs.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    return kids


def descendants(pid: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], list(kids.get(pid, ()))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


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
            du = shutil.disk_usage(self.disk_path)
            out.update(disk_free=du.free, disk_total=du.total,
                       disk_percent=round(100.0 * (du.total - du.free) / du.total, 1) if du.total else None)
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
