// cublaslt.cpp: an emulated cuBLASLt (libcublasLt.so) for the emulated driver (driver.cpp):
// the calls the CUDA backend makes, with the product computed on the host in f64 from the
// operands as stored (f32, f16 or bf16), column-major as cuBLASLt reads them, and written as
// f32. It runs on the stream through the driver, so a captured graph records it too.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_emu.h"

typedef int cublasStatus_t;
enum { OK = 0, NOT_SUPPORTED = 15, INVALID_VALUE = 7 };
enum { R_32F = 0, R_16F = 2, R_16BF = 14 };

extern "C" int cuda_emu_submit(void* stream, void (*op)(void*), void* arg, void (*drop)(void*));
extern "C" void cuda_emu_check_range(unsigned long long d, size_t n, const char* what);

namespace {
struct Layout {
    int type;
    uint64_t rows, cols;
    int64_t ld;
};
struct Desc {
    int transa = 0, transb = 0;
};
struct Product {
    Desc desc;
    Layout a, b, d;
    const void *pa, *pb;
    void* pd;
    float alpha, beta;
};

size_t width(int type) { return type == R_32F ? 4 : 2; }

double load(const void* p, int type, uint64_t i) {
    if (type == R_32F) return ((const float*)p)[i];
    const unsigned short h = ((const unsigned short*)p)[i];
    if (type == R_16F) return emu_h2f(h);
    return __uint_as_float((unsigned int)h << 16);
}

// Element (r, c) of op(X) for a column-major X.
double at(const void* p, const Layout& l, bool trans, uint64_t r, uint64_t c) {
    return trans ? load(p, l.type, c + r * l.ld) : load(p, l.type, r + c * l.ld);
}

void run(void* arg) {
    const Product& m = *(const Product*)arg;
    const bool ta = m.desc.transa, tb = m.desc.transb;
    const uint64_t rows = ta ? m.a.cols : m.a.rows, inner = ta ? m.a.rows : m.a.cols;
    const uint64_t cols = tb ? m.b.rows : m.b.cols;
    // op(A) by rows and op(B) by columns, each run of `inner` values contiguous.
    std::vector<double> a(rows * inner), b(cols * inner);
    for (uint64_t r = 0; r < rows; r++)
        for (uint64_t k = 0; k < inner; k++) a[r * inner + k] = at(m.pa, m.a, ta, r, k);
    for (uint64_t c = 0; c < cols; c++)
        for (uint64_t k = 0; k < inner; k++) b[c * inner + k] = at(m.pb, m.b, tb, k, c);
    float* d = (float*)m.pd;
    for (uint64_t c = 0; c < cols; c++) {
        for (uint64_t r = 0; r < rows; r++) {
            double s = 0;
            for (uint64_t k = 0; k < inner; k++) s += a[r * inner + k] * b[c * inner + k];
            float& out = d[r + c * m.d.ld];
            out = (float)(m.alpha * s + (m.beta != 0.0f ? m.beta * out : 0.0));
        }
    }
}
// Checks that the matrix `l` at `p` lies inside one allocation.
void check(const void* p, const Layout& l, const char* what) {
    const size_t n = l.cols ? ((l.cols - 1) * l.ld + l.rows) * width(l.type) : 0;
    cuda_emu_check_range((unsigned long long)(uintptr_t)p, n, what);
}
void drop(void* arg) { delete (Product*)arg; }
char handle_tag;
}  // namespace

#define API extern "C" __attribute__((visibility("default"))) cublasStatus_t

API cublasLtCreate(void** h) { *h = &handle_tag; return OK; }
API cublasLtDestroy(void*) { return OK; }
API cublasLtMatrixLayoutCreate(void** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    if (type != R_32F && type != R_16F && type != R_16BF) return NOT_SUPPORTED;
    *l = new Layout{type, rows, cols, ld};
    return OK;
}
API cublasLtMatrixLayoutDestroy(void* l) { delete (Layout*)l; return OK; }
API cublasLtMatmulDescCreate(void** d, int, int scale) {
    if (scale != R_32F) return NOT_SUPPORTED;
    *d = new Desc();
    return OK;
}
API cublasLtMatmulDescDestroy(void* d) { delete (Desc*)d; return OK; }
API cublasLtMatmulDescSetAttribute(void* d, int attr, const void* buf, size_t size) {
    Desc* desc = (Desc*)d;
    if ((attr == 3 || attr == 4) && size == 4) {
        (attr == 3 ? desc->transa : desc->transb) = *(const int*)buf;
        return OK;
    }
    return NOT_SUPPORTED;  // only the transposes are modelled
}
API cublasLtMatmulPreferenceCreate(void** p) { *p = new char(0); return OK; }
API cublasLtMatmulPreferenceDestroy(void* p) { delete (char*)p; return OK; }
API cublasLtMatmulPreferenceSetAttribute(void*, int, const void*, size_t) { return OK; }

// cublasLtMatmulHeuristicResult_t: the algorithm (8 u64), workspace size, state, waves, 4 ints.
struct Heuristic {
    uint64_t algo[8];
    size_t workspace;
    int state;
    float waves;
    int reserved[4];
};
API cublasLtMatmulAlgoGetHeuristic(void*, void*, void*, void*, void*, void*, void*, int wanted,
                                   Heuristic* out, int* count) {
    if (wanted < 1) return INVALID_VALUE;
    memset(out, 0, sizeof *out);
    *count = 1;
    return OK;
}

API cublasLtMatmul(void*, void* desc, const void* alpha, const void* a, void* la, const void* b,
                   void* lb, const void* beta, const void* c, void* lc, void* d, void* ld,
                   const void*, void*, size_t, void* stream) {
    const Layout &A = *(Layout*)la, &B = *(Layout*)lb, &C = *(Layout*)lc, &D = *(Layout*)ld;
    const Desc& ds = *(Desc*)desc;
    if (c != d || D.type != R_32F || C.type != R_32F || A.type != B.type) return NOT_SUPPORTED;
    const uint64_t rows = ds.transa ? A.cols : A.rows, inner = ds.transa ? A.rows : A.cols;
    const uint64_t inner_b = ds.transb ? B.cols : B.rows, cols = ds.transb ? B.rows : B.cols;
    if (inner != inner_b || D.rows != rows || D.cols != cols) return INVALID_VALUE;
    check(a, A, "cublasLtMatmul's A");
    check(b, B, "cublasLtMatmul's B");
    check(d, D, "cublasLtMatmul's D");
    Product* m = new Product{ds, A, B, D, a, b, d, *(const float*)alpha, *(const float*)beta};
    return cuda_emu_submit(stream, run, m, drop) == 0 ? OK : INVALID_VALUE;
}
