"""NVIDIA's management library (libnvidia-ml.so.1, installed with the driver) through ctypes.

The node side is standard library only, so no nvidia-ml-py: the few calls the GPU inventory needs are
bound here by hand, each with its C signature from nvml.h. `gpus()` raises Unavailable where the library
cannot be loaded or initialised (no driver, a container without it); the inventory then asks
`nvidia-smi`. A reading a GPU does not support (NVML_ERROR_NOT_SUPPORTED) is left out, never an error.
"""
import ctypes

LIBRARY = "libnvidia-ml.so.1"
SUCCESS, NOT_SUPPORTED, INSUFFICIENT_SIZE = 0, 3, 7
MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC = 1, 0


class Unavailable(Exception):
    """NVML cannot be used here; str() says why in words."""


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _Process(ctypes.Structure):  # nvmlProcessInfo_t (v2 and v3 of the call)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


class _ProcessV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _Pci(ctypes.Structure):  # nvmlPciInfo_t
    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint), ("bus", ctypes.c_uint),
                ("device", ctypes.c_uint), ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


def load(loader=ctypes.CDLL):
    """The initialised library; Unavailable where it is missing or will not start."""
    try:
        lib = loader(LIBRARY)
    except OSError:
        raise Unavailable("%s not found" % LIBRARY) from None
    init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
    code = init()
    if code != SUCCESS:
        raise Unavailable("NVML did not start: %s" % _words(lib, code))
    return lib


def _words(lib, code) -> str:
    try:
        lib.nvmlErrorString.restype = ctypes.c_char_p
        return lib.nvmlErrorString(code).decode("utf-8", "replace")
    except (AttributeError, OSError):
        return "error %d" % code


def _call(lib, name, *args) -> bool:
    """Whether the call answered; False where the GPU does not support it."""
    fn = getattr(lib, name, None)
    if fn is None:
        return False
    code = fn(*args)
    if code == NOT_SUPPORTED:
        return False
    if code != SUCCESS:
        raise Unavailable("%s: %s" % (name, _words(lib, code)))
    return True


def _text(lib, name, handle, size) -> str:
    buf = ctypes.create_string_buffer(size)
    return buf.value.decode("utf-8", "replace") if _call(lib, name, handle, buf, ctypes.c_uint(size)) else ""


def _processes(lib, handle) -> list:
    for name, struct in (("nvmlDeviceGetComputeRunningProcesses_v3", _Process),
                         ("nvmlDeviceGetComputeRunningProcesses_v2", _Process),
                         ("nvmlDeviceGetComputeRunningProcesses", _ProcessV1)):
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        count = ctypes.c_uint(0)
        code = fn(handle, ctypes.byref(count), None)
        while code == INSUFFICIENT_SIZE:  # a process may start between the two calls
            count = ctypes.c_uint(count.value + 8)
            infos = (struct * count.value)()
            code = fn(handle, ctypes.byref(count), infos)
            if code == SUCCESS:
                return [{"pid": p.pid, "mem": p.usedGpuMemory // (1 << 20)} for p in infos[:count.value]]
        if code == SUCCESS:
            return []
        raise Unavailable("%s: %s" % (name, _words(lib, code)))
    return []


def _health(lib, handle) -> list:
    health = []
    ecc = ctypes.c_ulonglong(0)
    if _call(lib, "nvmlDeviceGetTotalEccErrors", handle, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC,
             ctypes.byref(ecc)) and ecc.value > 0:
        health.append("uncorrected ECC")
    pending = ctypes.c_uint(0)
    if _call(lib, "nvmlDeviceGetRetiredPagesPendingStatus", handle, ctypes.byref(pending)) and pending.value:
        health.append("retired page pending")
    rows = [ctypes.c_uint(0) for _ in range(4)]  # corrected, uncorrected, pending, failure occurred
    if _call(lib, "nvmlDeviceGetRemappedRows", handle, *(ctypes.byref(r) for r in rows)) and rows[3].value:
        health.append("remapped row failure")
    return health


def gpus(loader=ctypes.CDLL) -> list:
    """Every GPU as the inventory's records (memory in MiB), with its PCI address for the kernel log's XIDs."""
    lib = load(loader)
    try:
        count = ctypes.c_uint(0)
        name = "nvmlDeviceGetCount_v2" if getattr(lib, "nvmlDeviceGetCount_v2", None) else "nvmlDeviceGetCount"
        _call(lib, name, ctypes.byref(count))
        out = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            _call(lib, "nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(i), ctypes.byref(handle))
            mem, pci = _Memory(), _Pci()
            has_mem = _call(lib, "nvmlDeviceGetMemoryInfo", handle, ctypes.byref(mem))
            g = {"index": i, "uuid": _text(lib, "nvmlDeviceGetUUID", handle, 96),
                 "name": _text(lib, "nvmlDeviceGetName", handle, 96),
                 "mem_total": mem.total // (1 << 20) if has_mem else None,
                 "mem_used": mem.used // (1 << 20) if has_mem else None,
                 "health": _health(lib, handle), "processes": _processes(lib, handle)}
            if _call(lib, "nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci)):
                g["pci"] = "%04x:%02x:%02x" % (pci.domain, pci.bus, pci.device)
            out.append(g)
        return out
    finally:
        if getattr(lib, "nvmlShutdown", None) is not None:
            lib.nvmlShutdown()
