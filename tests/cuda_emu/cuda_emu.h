// cuda_emu.h: a minimal CPU emulation of the CUDA C features the kernels in src/kernels/cuda/
// use, so they can be compiled with g++ and checked on a machine without a GPU.
//
// Model: the blocks of a launch run one after another; each thread of a block is a ucontext
// fiber. A fiber runs until it reaches a barrier (__syncthreads, or a warp shuffle, which is a
// barrier of its 32 lanes), and the scheduler releases a barrier once every thread it involves
// has reached it. A deadlock, a __syncthreads some threads skip by returning, or a shuffle with
// exited lanes aborts the process with "EMU ERROR". Not modelled: timing, concurrency between
// blocks, memory ordering (a race the barriers do not order goes unnoticed), bounds checks,
// and the exact rounding of the device's fast paths (expf, sincosf, ... are the host libm's).
//
// Only 1-D launches, blockDim.x a multiple of 32; shuffles need the full mask.
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint3_ { unsigned int x, y, z; };
static uint3_ threadIdx, blockIdx, blockDim, gridDim;

struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned int x, y; };
struct alignas(16) uint4 { unsigned int x, y, z, w; };
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
using std::isfinite;
using std::max;
using std::min;

// IEEE half bits -> f32, exactly (stands in for PTX cvt.f32.f16). NaN payloads are kept.
static inline float emu_h2f(unsigned short h) {
    const unsigned int sign = (unsigned int)(h & 0x8000u) << 16;
    const unsigned int e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  // zero or subnormal: m * 2^-24, exact in f32
        const float f = (float)m * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    const unsigned int bits = sign | (e == 0x1f ? 0x7f800000u : (e + 112u) << 23) | (m << 13);
    return __uint_as_float(bits);
}

// f32 -> IEEE half bits, round to nearest even, overflow to inf, NaN to a quiet NaN (stands in
// for PTX cvt.rn.f16.f32).
static inline unsigned short emu_f2h(float f) {
    const unsigned int u = __float_as_uint(f);
    const unsigned int sign = (u >> 16) & 0x8000u;
    const unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520: inf
    if (a >= 0x38800000u) {  // a normal half: re-bias the exponent, round off 13 bits
        const unsigned int r = a - 0x38000000u;
        return (unsigned short)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
    }
    // Subnormal half or zero: |f| * 2^24 (exact) rounded to an integer, ties to even.
    return (unsigned short)(sign | (unsigned int)std::nearbyint(std::fabs(f) * 16777216.0f));
}

static inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (int n = 0; n < 4; n++) r |= (unsigned int)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}

namespace emu {
enum { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
// A fiber starts through its ucontext (makecontext gives it its stack) and then switches
// with GCC's __builtin_setjmp/__builtin_longjmp, which save and restore only the frame, stack
// and resume addresses (the setjmp's caller keeps every other register in its frame), unlike
// swapcontext (a system call for the signal mask) or longjmp (unwinding checks).
typedef void* JmpBuf[5];
struct Fiber {
    ucontext_t ctx;
    JmpBuf jb;
    bool started;
    int state;
};
static std::vector<Fiber> fibers;
static std::vector<char*> stacks;
static ucontext_t sched;
static JmpBuf sched_jb;
static int cur = -1;
static std::function<void()> body;  // the running launch's kernel call
static unsigned long long slots[32][32];  // shuffle values, [warp][lane]
static const size_t STACK = 256 * 1024;

static void fail(const char* m) {
    fprintf(stderr, "EMU ERROR: %s (block %u)\n", m, blockIdx.x);
    fflush(stderr);
    abort();
}
// A fiber runs the kernel for its thread of each block in turn: ended, it waits for the next
// block, so fibers (and their stacks) are made once.
// __builtin_longjmp must not be called by a function that calls __builtin_setjmp.
__attribute__((noinline)) static void jump(JmpBuf b) { __builtin_longjmp(b, 1); }
static void trampoline() {
    for (;;) {
        body();
        fibers[cur].state = DONE;
        if (!__builtin_setjmp(fibers[cur].jb)) jump(sched_jb);
    }
}
__attribute__((noinline)) static void wait(int st) {
    fibers[cur].state = st;
    if (!__builtin_setjmp(fibers[cur].jb)) jump(sched_jb);
}
// Runs fiber `i` until it waits or ends.
__attribute__((noinline)) static void resume(int i) {
    if (__builtin_setjmp(sched_jb)) return;
    if (fibers[i].started) jump(fibers[i].jb);
    fibers[i].started = true;
    swapcontext(&sched, &fibers[i].ctx);
}

static void run_block(int nthreads) {
    fibers.reserve(1024);  // never moved: a ucontext points into itself
    for (int i = (int)fibers.size(); i < nthreads; i++) {
        fibers.emplace_back();
        stacks.push_back((char*)malloc(STACK));
        getcontext(&fibers[i].ctx);
        fibers[i].ctx.uc_stack.ss_sp = stacks[i];
        fibers[i].ctx.uc_stack.ss_size = STACK;
        fibers[i].ctx.uc_link = nullptr;
        makecontext(&fibers[i].ctx, trampoline, 0);
        fibers[i].started = false;
    }
    for (int i = 0; i < nthreads; i++) fibers[i].state = RUN;
    const int nwarps = nthreads / 32;
    for (;;) {
        bool progress = false;
        for (int i = 0; i < nthreads; i++) {
            if (fibers[i].state == RUN) {
                cur = i;
                threadIdx = {(unsigned)i, 0, 0};
                resume(i);
                progress = true;
            }
        }
        int done = 0, wb = 0, running = 0;
        for (int i = 0; i < nthreads; i++) {
            if (fibers[i].state == DONE) done++;
            if (fibers[i].state == WAIT_BLOCK) wb++;
            if (fibers[i].state == RUN) running++;
        }
        if (done == nthreads) break;
        bool released = false;
        // A warp barrier is released when all 32 lanes wait at it.
        for (int w = 0; w < nwarps; w++) {
            int waiting = 0, dn = 0;
            for (int l = 0; l < 32; l++) {
                const int s = fibers[w * 32 + l].state;
                if (s == WAIT_WARP) waiting++;
                if (s == DONE) dn++;
            }
            if (waiting == 32) {
                for (int l = 0; l < 32; l++) fibers[w * 32 + l].state = RUN;
                released = true;
            } else if (waiting > 0 && running == 0 && waiting + dn == 32 && dn > 0) {
                fail("shuffle with exited lanes");
            }
        }
        // A block barrier is released when every thread waits at it.
        if (!released && running == 0 && wb > 0 && wb + done == nthreads) {
            if (done > 0) fail("__syncthreads with exited threads");
            for (int i = 0; i < nthreads; i++) fibers[i].state = RUN;
            released = true;
        }
        if (!progress && !released) fail("deadlock");
    }
}

template <class F>
static void launch(int gx, int gy, int gz, int block, F f) {
    if (gx < 1 || gy < 1 || gz < 1) fail("a grid dimension < 1 (an invalid launch on a device)");
    if (block < 32 || block > 1024 || block % 32) fail("blockDim.x not a multiple of 32 in 32..=1024");
    body = f;
    gridDim = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
    blockDim = {(unsigned)block, 1, 1};
    for (int z = 0; z < gz; z++)
        for (int y = 0; y < gy; y++)
            for (int x = 0; x < gx; x++) {
                blockIdx = {(unsigned)x, (unsigned)y, (unsigned)z};
                run_block(block);
            }
    body = nullptr;
}
}  // namespace emu

static inline void __syncthreads() { emu::wait(emu::WAIT_BLOCK); }

template <class T>
static inline T emu_shfl(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 8, "shuffled values are at most 8 bytes");
    if (mask != 0xffffffffu) emu::fail("shuffle mask other than 0xffffffff");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    emu::slots[warp][lane] = bits;
    emu::wait(emu::WAIT_WARP);  // every lane has published
    T r;
    const unsigned long long got = emu::slots[warp][src & 31];
    memcpy(&r, &got, sizeof(T));
    emu::wait(emu::WAIT_WARP);  // every lane has read before the slots are reused
    return r;
}
template <class T>
static inline T __shfl_xor_sync(unsigned m, T v, int o) {
    return emu_shfl(m, v, (int)(threadIdx.x & 31) ^ o);
}
template <class T>
static inline T __shfl_sync(unsigned m, T v, int s) {
    return emu_shfl(m, v, s);
}

// A launch bound to its kernel and its arguments, copied as cuLaunchKernel reads them
// (`params[i]` points at argument i): what the emulated driver (driver.cpp) runs at once, or
// keeps in a graph to run at every replay.
struct EmuCall {
    virtual void run(int gx, int gy, int gz, int block) = 0;
    virtual ~EmuCall() {}
};

// EMU_EXPORT(kernel) exports `void* L_kernel`, the address of a host function
// void(int grid_x, int grid_y, int grid_z, int block, <the kernel's arguments>) that runs
// the launch, and `void* C_kernel`, the address of EmuCall* (void** params) that binds one.
template <class K> struct Launcher;
template <class... A> struct Launcher<void (*)(A...)> {
    template <void (*K)(A...)>
    static void run(int gx, int gy, int gz, int block, A... a) {
        emu::launch(gx, gy, gz, block, [&]() { K(a...); });
    }
    template <void (*K)(A...)>
    struct Call : EmuCall {
        std::tuple<A...> args;
        template <size_t... I>
        Call(void** p, std::index_sequence<I...>) : args(*static_cast<A*>(p[I])...) {}
        void run(int gx, int gy, int gz, int block) override {
            emu::launch(gx, gy, gz, block, [&]() { std::apply(K, args); });
        }
    };
    template <void (*K)(A...)>
    static EmuCall* bind(void** params) {
        return new Call<K>(params, std::index_sequence_for<A...>{});
    }
};
#define EMU_EXPORT(name)                                                            \
    extern "C" {                                                                     \
    void* L_##name = (void*)&Launcher<decltype(&name)>::template run<&name>;       \
    void* C_##name = (void*)&Launcher<decltype(&name)>::template bind<&name>;      \
    }
