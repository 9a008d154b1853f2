/* A STAND-IN for libnvidia-ml.so.1 (no GPU in the tests): the calls fabtrain/node/nvml.py makes, with the
 * types and structs of NVIDIA's nvml.h, answering for two fixed GPUs. GPU 0 runs two compute processes
 * (the first call is told the buffer is too small, as the real library does); GPU 1 has uncorrected ECC
 * errors and a remapped row failure, and does not support the retired-pages query. */
#include <string.h>

typedef void *nvmlDevice_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int pid; unsigned long long usedGpuMemory; unsigned int gpuInstanceId, computeInstanceId; } nvmlProcessInfo_t;
typedef struct { char busIdLegacy[16]; unsigned int domain, bus, device, pciDeviceId, pciSubSystemId; char busId[32]; } nvmlPciInfo_t;
enum { OK = 0, INVALID = 2, NOT_SUPPORTED = 3, INSUFFICIENT_SIZE = 7 };

static int gpu[2] = {0, 1};
static int index_of(nvmlDevice_t d) { return d == &gpu[1]; }

int nvmlInit_v2(void) { return OK; }
int nvmlShutdown(void) { return OK; }
const char *nvmlErrorString(int code) { return code == INVALID ? "Invalid Argument" : "Unknown Error"; }
int nvmlDeviceGetCount_v2(unsigned int *count) { *count = 2; return OK; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    if (i > 1) return INVALID;
    *d = &gpu[i];
    return OK;
}
int nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int n) { strncpy(name, "Stand-in H100", n); return OK; }
int nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int n) {
    strncpy(uuid, index_of(d) ? "GPU-bbb" : "GPU-aaa", n);
    return OK;
}
int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    m->total = 81559ULL << 20;
    m->used = index_of(d) ? 0 : 30000ULL << 20;
    m->free = m->total - m->used;
    return OK;
}
int nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    unsigned int have = index_of(d) ? 0 : 2;
    if (*count < have) { *count = have; return INSUFFICIENT_SIZE; }
    for (unsigned int i = 0; i < have; i++) {
        infos[i].pid = 4242 + i;
        infos[i].usedGpuMemory = (10000ULL + i) << 20;
        infos[i].gpuInstanceId = infos[i].computeInstanceId = 0xFFFFFFFF;
    }
    *count = have;
    return OK;
}
int nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int type, int counter, unsigned long long *n) {
    if (type != 1 || counter != 0) return INVALID;  /* uncorrected, volatile */
    *n = index_of(d) ? 3 : 0;
    return OK;
}
int nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, unsigned int *pending) {
    if (index_of(d)) return NOT_SUPPORTED;
    *pending = 0;
    return OK;
}
int nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corr, unsigned int *unc, unsigned int *pending,
                              unsigned int *failure) {
    *corr = 0; *unc = index_of(d) ? 2 : 0; *pending = 0; *failure = index_of(d);
    return OK;
}
int nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    memset(pci, 0, sizeof *pci);
    pci->domain = 0; pci->bus = index_of(d) ? 0x3b : 0x18; pci->device = 0;
    return OK;
}
