"""What the agent measures besides processes: the host (CPU, load, memory, swap, disk,
network, from /proc) and NVIDIA GPUs (through NVML, only where a driver is present).

Standard library only; nvidia-ml-py is imported lazily, only where a driver
is present, so the node side needs nothing installed.
"""
from __future__ import annotations

import os
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
