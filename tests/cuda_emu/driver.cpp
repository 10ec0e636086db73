// driver.cpp: an emulated CUDA driver (libcuda.so) over the kernel emulator, so the CUDA
// backend's host code (memory, copies, launches, CUDA graphs) runs on a machine without a GPU.
// Built by build.py into <build>/driver/ beside a libcublasLt.so (cublaslt.cpp); the kernel
// libraries are read from <build>/ (the folder above this library).
//
// Model: one device, compute capability 9.0; device memory is host memory (a device address
// is the host address); every operation runs at once on the calling thread, in call order,
// one at a time (the kernel emulator is not reentrant), so streams and events order nothing.
// A stream being captured records launches, copies between device buffers and memsets into
// its graph instead; copies to or from the host and synchronization there fail, as on a
// device. Memory a capture allocates belongs to the graph until it is destroyed, and a replay
// fills it with garbage first. Checked on top: new memory is filled with 0xff bytes (NaN in
// f32, f16 and bf16), so reading what no one wrote shows; each allocation is followed by a
// guard zone, checked when it is freed, so a write past the end aborts with "EMU ERROR".
// Not modelled: timing, concurrency, launches' shared memory, the kernels' cubins (NVRTC
// still compiles them; the emulator runs the same sources compiled by g++).
#include <dlfcn.h>
#include <dirent.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_emu.h"

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

static const size_t GUARD = 256;  // bytes of guard zone after each allocation
static const unsigned char GUARD_BYTE = 0xa5;

namespace {

struct Graph {
    std::vector<std::function<void()>> ops;
    std::vector<CUdeviceptr> owned;  // allocated while capturing
};

struct Stream {
    Graph* capture = nullptr;  // the graph being captured, or none
    bool invalidated = false;  // an unsupported operation happened while capturing
};

struct Function {
    EmuCall* (*bind)(void** params);
    std::string name;
};

std::recursive_mutex big_lock;  // one operation at a time
std::map<CUdeviceptr, size_t> allocations;
size_t allocated = 0;
Stream default_stream;
char context_tag, pool_tag, module_tag;

size_t total_memory() {
    const char* mb = getenv("CUDA_EMU_MEMORY_MB");
    return (size_t)(mb ? atol(mb) : 4096) << 20;
}

void emu_fail(const std::string& what) {
    fprintf(stderr, "EMU ERROR: %s\n", what.c_str());
    fflush(stderr);
    abort();
}

Stream* stream_of(void* s) { return s ? static_cast<Stream*>(s) : &default_stream; }

// Runs `op` now, or records it into the stream's capture.
CUresult submit(void* s, std::function<void()> op) {
    Stream* st = stream_of(s);
    if (st->capture) {
        st->capture->ops.push_back(std::move(op));
    } else {
        op();
    }
    return CUDA_SUCCESS;
}

// An operation a capture cannot record invalidates it, as on a device.
CUresult not_while_capturing(void* s) {
    Stream* st = stream_of(s);
    if (!st->capture) return CUDA_SUCCESS;
    st->invalidated = true;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

CUdeviceptr allocate(size_t n) {
    unsigned char* p = static_cast<unsigned char*>(malloc(n + GUARD));
    if (!p) return 0;
    memset(p, 0xff, n);
    memset(p + n, GUARD_BYTE, GUARD);
    const CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;
    allocations[d] = n;
    allocated += n;
    return d;
}

void release(CUdeviceptr d) {
    auto it = allocations.find(d);
    if (it == allocations.end()) emu_fail("free of an address no allocation starts at");
    const unsigned char* p = (const unsigned char*)(uintptr_t)d;
    for (size_t i = 0; i < GUARD; i++) {
        if (p[it->second + i] != GUARD_BYTE) {
            char m[160];
            snprintf(m, sizeof m, "a write past the end of an allocation of %zu bytes (at +%zu)",
                     it->second, i);
            emu_fail(m);
        }
    }
    allocated -= it->second;
    allocations.erase(it);
    free((void*)(uintptr_t)d);
}

// Checks that [d, d + n) lies inside one allocation.
void check_range(CUdeviceptr d, size_t n, const char* what) {
    auto it = allocations.upper_bound(d);
    if (it != allocations.begin()) {
        --it;
        if (d >= it->first && d + n <= it->first + it->second) return;
    }
    char m[160];
    snprintf(m, sizeof m, "%s of %zu bytes outside every allocation", what, n);
    emu_fail(m);
}

// The kernel libraries: every <build>/*.cu.so next to the folder of this library.
std::vector<void*>& kernel_libraries() {
    static std::vector<void*> libs;
    static bool loaded = false;
    if (loaded) return libs;
    loaded = true;
    Dl_info info;
    if (!dladdr((void*)&kernel_libraries, &info)) emu_fail("dladdr failed");
    std::string dir = info.dli_fname;
    dir = dir.substr(0, dir.rfind('/'));        // <build>/driver
    dir = dir.substr(0, dir.rfind('/'));        // <build>
    DIR* d = opendir(dir.c_str());
    if (!d) emu_fail("no kernel library folder " + dir);
    while (dirent* e = readdir(d)) {
        const std::string n = e->d_name;
        if (n.size() > 6 && n.compare(n.size() - 6, 6, ".cu.so") == 0) {
            void* h = dlopen((dir + "/" + n).c_str(), RTLD_NOW | RTLD_LOCAL);
            if (!h) emu_fail(std::string("dlopen: ") + dlerror());
            libs.push_back(h);
        }
    }
    closedir(d);
    if (libs.empty()) emu_fail("no kernel libraries (*.cu.so) in " + dir);
    return libs;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default"))) CUresult
#define LOCK std::lock_guard<std::recursive_mutex> guard(big_lock)

API cuInit(unsigned) { return CUDA_SUCCESS; }
API cuDriverGetVersion(int* v) { *v = 13000; return CUDA_SUCCESS; }
API cuDeviceGetCount(int* n) { *n = 1; return CUDA_SUCCESS; }
API cuDeviceGet(int* dev, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_VALUE;
    *dev = 0;
    return CUDA_SUCCESS;
}
API cuDeviceGetName(char* name, int len, int) {
    snprintf(name, len, "cuda_emu");
    return CUDA_SUCCESS;
}
API cuDeviceTotalMem_v2(size_t* bytes, int) { *bytes = total_memory(); return CUDA_SUCCESS; }
API cuDeviceGetAttribute(int* v, int attribute, int) {
    switch (attribute) {
        case 16: *v = 132; break;   // multiprocessors
        case 75: *v = 9; break;     // compute capability, major
        case 76: *v = 0; break;     // minor
        case 115: *v = 1; break;    // memory pools supported
        case 1: *v = 1024; break;   // threads per block
        case 10: *v = 32; break;    // warp size
        default: *v = 0;
    }
    return CUDA_SUCCESS;
}
API cuDevicePrimaryCtxRetain(void** ctx, int) { *ctx = &context_tag; return CUDA_SUCCESS; }
API cuDevicePrimaryCtxRelease_v2(int) { return CUDA_SUCCESS; }
API cuCtxSetCurrent(void*) { return CUDA_SUCCESS; }
API cuCtxGetCurrent(void** ctx) { *ctx = &context_tag; return CUDA_SUCCESS; }
API cuCtxPushCurrent_v2(void*) { return CUDA_SUCCESS; }
API cuCtxPopCurrent_v2(void** ctx) { if (ctx) *ctx = &context_tag; return CUDA_SUCCESS; }
API cuCtxGetDevice(int* dev) { *dev = 0; return CUDA_SUCCESS; }
API cuCtxSynchronize() { return CUDA_SUCCESS; }

API cuGetErrorString(int e, const char** s) {
    switch (e) {
        case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
            *s = "operation not permitted when stream is capturing";
            break;
        case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
            *s = "operation failed due to a previous error during capture";
            break;
        default: *s = "emulated driver error";
    }
    return CUDA_SUCCESS;
}
API cuGetErrorName(int e, const char** s) { return cuGetErrorString(e, s); }

API cuStreamCreate(void** s, unsigned) { *s = new Stream(); return CUDA_SUCCESS; }
API cuStreamCreateWithPriority(void** s, unsigned, int) { *s = new Stream(); return CUDA_SUCCESS; }
API cuStreamDestroy_v2(void* s) {
    LOCK;
    delete static_cast<Stream*>(s);
    return CUDA_SUCCESS;
}
API cuStreamSynchronize(void* s) {
    LOCK;
    return not_while_capturing(s);
}
API cuStreamQuery(void* s) { return cuStreamSynchronize(s); }
API cuStreamWaitEvent(void*, void*, unsigned) { return CUDA_SUCCESS; }
API cuStreamBeginCapture_v2(void* s, int) {
    LOCK;
    Stream* st = stream_of(s);
    if (st->capture) return CUDA_ERROR_INVALID_VALUE;
    st->capture = new Graph();
    st->invalidated = false;
    return CUDA_SUCCESS;
}
API cuStreamIsCapturing(void* s, int* status) {
    *status = stream_of(s)->capture ? (stream_of(s)->invalidated ? 2 : 1) : 0;
    return CUDA_SUCCESS;
}
API cuStreamEndCapture(void* s, void** graph) {
    LOCK;
    Stream* st = stream_of(s);
    if (!st->capture) return CUDA_ERROR_INVALID_VALUE;
    Graph* g = st->capture;
    st->capture = nullptr;
    if (st->invalidated) {
        for (CUdeviceptr d : g->owned) release(d);
        delete g;
        *graph = nullptr;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *graph = g;
    return CUDA_SUCCESS;
}
API cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    *exec = graph;  // the executable graph is the captured one
    return CUDA_SUCCESS;
}
API cuGraphUpload(void*, void*) { return CUDA_SUCCESS; }
API cuGraphLaunch(void* exec, void* s) {
    LOCK;
    Stream* st = stream_of(s);
    if (st->capture) {
        st->invalidated = true;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    for (auto& op : static_cast<Graph*>(exec)->ops) op();
    return CUDA_SUCCESS;
}
API cuGraphExecDestroy(void*) { return CUDA_SUCCESS; }
API cuGraphDestroy(void* graph) {
    LOCK;
    Graph* g = static_cast<Graph*>(graph);
    for (CUdeviceptr d : g->owned) release(d);
    delete g;
    return CUDA_SUCCESS;
}

API cuMemAlloc_v2(CUdeviceptr* d, size_t n) {
    LOCK;
    if (allocated + n > total_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
    *d = allocate(n);
    return *d ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
API cuMemFree_v2(CUdeviceptr d) {
    LOCK;
    release(d);
    return CUDA_SUCCESS;
}
API cuMemAllocAsync(CUdeviceptr* d, size_t n, void* s) {
    LOCK;
    const CUresult r = cuMemAlloc_v2(d, n);
    Stream* st = stream_of(s);
    if (r == CUDA_SUCCESS && st->capture) {
        // The graph owns it; each replay starts from undefined contents.
        st->capture->owned.push_back(*d);
        unsigned char* p = (unsigned char*)(uintptr_t)*d;
        st->capture->ops.push_back([p, n]() { memset(p, 0xff, n); });
    }
    return r;
}
API cuMemFreeAsync(CUdeviceptr d, void* s) {
    LOCK;
    Stream* st = stream_of(s);
    if (st->capture) {
        for (CUdeviceptr o : st->capture->owned)
            if (o == d) return CUDA_SUCCESS;  // freed with the graph
        st->invalidated = true;  // freeing memory the graph does not own: not modelled
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    release(d);
    return CUDA_SUCCESS;
}
API cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    LOCK;
    *total = total_memory();
    *free_bytes = *total - allocated;
    return CUDA_SUCCESS;
}
API cuDeviceGetDefaultMemPool(void** pool, int) { *pool = &pool_tag; return CUDA_SUCCESS; }
API cuMemPoolSetAttribute(void*, int, void*) { return CUDA_SUCCESS; }
API cuMemPoolTrimTo(void*, size_t) { return CUDA_SUCCESS; }

API cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    LOCK;
    if (CUresult r = not_while_capturing(s)) return r;
    check_range(dst, n, "a copy to the device");
    memcpy((void*)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}
API cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr);
}
API cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    LOCK;
    if (CUresult r = not_while_capturing(s)) return r;
    check_range(src, n, "a copy to the host");
    memcpy(dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
API cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr);
}
API cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    LOCK;
    check_range(dst, n, "a device copy's destination");
    check_range(src, n, "a device copy's source");
    return submit(s, [=]() { memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n); });
}
API cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* s) {
    LOCK;
    check_range(dst, n, "a memset");
    return submit(s, [=]() { memset((void*)(uintptr_t)dst, v, n); });
}
API cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    return cuMemsetD8Async(dst, v, n, nullptr);
}
API cuMemsetD32Async(CUdeviceptr dst, unsigned int v, size_t n, void* s) {
    LOCK;
    check_range(dst, 4 * n, "a memset");
    return submit(s, [=]() {
        unsigned int* p = (unsigned int*)(uintptr_t)dst;
        for (size_t i = 0; i < n; i++) p[i] = v;
    });
}

API cuModuleLoadData(void** module, const void*) { *module = &module_tag; return CUDA_SUCCESS; }
API cuModuleUnload(void*) { return CUDA_SUCCESS; }
API cuModuleGetFunction(void** f, void*, const char* name) {
    LOCK;
    const std::string sym = std::string("C_") + name;
    for (void* lib : kernel_libraries()) {
        if (void** bind = (void**)dlsym(lib, sym.c_str())) {
            *f = new Function{(EmuCall * (*)(void**)) * bind, name};
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_NOT_FOUND;
}
API cuFuncGetAttribute(int* v, int, void*) { *v = 0; return CUDA_SUCCESS; }
API cuFuncSetAttribute(void*, int, int) { return CUDA_SUCCESS; }
API cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned, void* s, void** params, void** extra) {
    LOCK;
    Function* fn = static_cast<Function*>(f);
    if (extra) emu_fail(fn->name + ": launch with `extra` arguments");
    if (by != 1 || bz != 1) emu_fail(fn->name + ": a block of more than one dimension");
    std::shared_ptr<EmuCall> call(fn->bind(params));
    return submit(s, [=]() { call->run((int)gx, (int)gy, (int)gz, (int)bx); });
}

API cuEventCreate(void** e, unsigned) { *e = new char(0); return CUDA_SUCCESS; }
API cuEventDestroy_v2(void* e) { delete static_cast<char*>(e); return CUDA_SUCCESS; }
API cuEventRecord(void*, void*) { return CUDA_SUCCESS; }
API cuEventSynchronize(void*) { return CUDA_SUCCESS; }
API cuEventQuery(void*) { return CUDA_SUCCESS; }
API cuEventElapsedTime(float* ms, void*, void*) { *ms = 0.0f; return CUDA_SUCCESS; }
API cuEventElapsedTime_v2(float* ms, void*, void*) { *ms = 0.0f; return CUDA_SUCCESS; }

// For cublaslt.cpp: runs `op` on stream `s`, or records it there.
extern "C" __attribute__((visibility("default"))) int cuda_emu_submit(void* s, void (*op)(void*),
                                                                      void* arg,
                                                                      void (*drop)(void*)) {
    LOCK;
    std::shared_ptr<void> owned(arg, drop);
    return submit(s, [op, owned]() { op(owned.get()); });
}

// For cublaslt.cpp: checks a device range as the copies do.
extern "C" __attribute__((visibility("default"))) void cuda_emu_check_range(unsigned long long d,
                                                                            size_t n,
                                                                            const char* what) {
    LOCK;
    check_range(d, n, what);
}
