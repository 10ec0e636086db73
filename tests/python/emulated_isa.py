"""Runs the quantized matmul's SIMD paths on an emulated CPU (one of Bochs' CPU models,
through the `bochscpu-python` package), so instruction sets this machine lacks (AVX-512 VNNI,
AVX-VNNI) are checked against the portable path.

usage: emulated_isa.py LIBRARY CPU
  LIBRARY  the `emulated_kernels` example, a shared library
  CPU      `sapphire_rapids` (AVX-512 VNNI and AVX-VNNI: every path must match),
           `arrow_lake` (AVX-VNNI, no AVX-512) or `tigerlake` (AVX-512 VNNI, no AVX-VNNI): a
           path whose instructions the model lacks must fault on the first of them, which
           shows the emulator enforces the instruction set and the path really uses them

The emulated CPU runs in 64-bit mode over this process's own memory: every 1 GiB region the
process has mapped is one large page, numbered compactly in guest-physical space from 4 GiB up
(the model's physical addresses are narrower than a host's virtual ones, and below 4 GiB its own
local APIC answers at 0xFEE00000 in place of memory), and a guest-physical page is backed by the
host page at the same offset of its region. A case is prepared natively, the
function under test runs in the emulator on this thread's stack-free copy of the state (its
own stack, this thread's TLS base), returns into a `hlt`, and is checked natively. Prints one
line per case and exits non-zero on any mismatch or emulation fault.
"""

import ctypes
import faulthandler
import os
import subprocess
import sys
import tempfile

GLIBC_SHIM = r"""
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
unsigned long long __isoc23_strtoull(const char *s, char **e, int b) { return strtoull(s, e, b); }
int __isoc23_sscanf(const char *s, const char *f, ...) {
    va_list ap; va_start(ap, f); int r = vsscanf(s, f, ap); va_end(ap); return r;
}
"""


def import_bochscpu():
    """The package's wheel is built against glibc >= 2.38 (two C23 symbols); on an older
    glibc, re-run this script with a two-function shim preloaded."""
    try:
        import bochscpu  # noqa: F401
    except ImportError as e:
        if "__isoc23" not in str(e) or os.environ.get("EMU_SHIM"):
            raise
        shim_dir = tempfile.mkdtemp()
        src, lib = os.path.join(shim_dir, "shim.c"), os.path.join(shim_dir, "libshim.so")
        with open(src, "w") as f:
            f.write(GLIBC_SHIM)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", lib, src], check=True)
        env = dict(os.environ, LD_PRELOAD=lib, EMU_SHIM="1")
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    import bochscpu
    import bochscpu.cpu
    import bochscpu.memory

    return bochscpu


bochscpu = import_bochscpu()
mem = bochscpu.memory

GIB = 1 << 30
PAGE = 4096
# The first guest-physical slot (in GiB). The emulated CPU serves its local APIC's page,
# 0xFEE00000, itself: a region given the fourth slot would have its page at offset 0x3EE00000
# read as APIC registers (an instruction fetch there gets no host page and crashes the emulator).
FIRST_SLOT = 4
# Indices of Bochs' CPU models in bochscpu's `cpu.model` list (their features are checked
# below through CPUID, so a different list fails loudly).
CPU_MODELS = {"tigerlake": 29, "sapphire_rapids": 30, "arrow_lake": 31}
# What each model must report: AVX-512 (F, BW, VL, VNNI) and AVX-VNNI.
MODEL_HAS = {"tigerlake": (True, False), "sapphire_rapids": (True, True),
             "arrow_lake": (False, True)}
INVALID_OPCODE = 6

libc = ctypes.CDLL(None)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]


def host_alloc(size):
    p = libc.mmap(None, size, 3, 0x22, -1, 0)  # read|write, private|anonymous
    if p in (None, ctypes.c_void_p(-1).value):
        raise MemoryError(size)
    return p


def select_cpu_model(index):
    lib = ctypes.CDLL(bochscpu._bochscpu.__file__)
    sim = ctypes.c_void_p.in_dll(lib, "SIM")
    get = lib._ZN13bx_real_sim_c14get_param_enumEPKcP10bx_param_c
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    param = get(sim, b"cpu.model", None)
    set_value = lib._ZN14bx_param_num_c3setEl
    set_value.argtypes = [ctypes.c_void_p, ctypes.c_long]
    set_value(param, index)


class Fault(RuntimeError):
    def __init__(self, vector, message):
        super().__init__(message)
        self.vector = vector


class Emulator:
    def __init__(self, fs_base, model):
        self.fs_base = fs_base
        self.slots = {}  # 1 GiB host region -> guest-physical slot (from FIRST_SLOT)
        self.max_slots = None  # from the model's physical address width, once read
        self.tables = host_alloc(PAGE * 64)  # PML4, then one PDPT per 512 GiB
        self.pdpts = {}
        self.stack = host_alloc(1 << 20)
        self.sentinel = host_alloc(PAGE)
        ctypes.memmove(self.sentinel, b"\xf4", 1)  # hlt
        select_cpu_model(CPU_MODELS[model])
        self.session = bochscpu.Session()
        self.session.missing_page_handler = self.missing_page
        self.fault = None

    def gpa(self, hva):
        return self.slots[hva >> 30] << 30 | (hva & (GIB - 1))

    def map_process(self):
        """Gives every mapped 1 GiB region of this process a slot and a large page."""
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if hi > 1 << 47:
                    continue
                for region in range(lo >> 30, ((hi - 1) >> 30) + 1):
                    self.slots.setdefault(region, len(self.slots) + FIRST_SLOT)
        if self.max_slots is not None and len(self.slots) + FIRST_SLOT > self.max_slots:
            raise RuntimeError(f"{len(self.slots)} regions of 1 GiB mapped: past the model's "
                               "guest-physical addresses")
        for region, slot in self.slots.items():
            top, mid = region >> 9, region & 511
            if top not in self.pdpts:
                if len(self.pdpts) == 63:
                    raise RuntimeError("too many 512 GiB areas mapped")
                self.pdpts[top] = self.tables + PAGE * (len(self.pdpts) + 1)
            # present | writable | user | large (1 GiB)
            ctypes.c_uint64.from_address(self.pdpts[top] + 8 * mid).value = slot << 30 | 0x87
        for top, pdpt in self.pdpts.items():
            ctypes.c_uint64.from_address(self.tables + 8 * top).value = self.gpa(pdpt) | 0x7

    def missing_page(self, gpa):
        page = gpa & ~(PAGE - 1)
        for region, slot in self.slots.items():
            if slot == page >> 30:
                mem.page_insert(page, (region << 30) | (page & (GIB - 1)))
                return
        raise RuntimeError(f"guest-physical page {gpa:#x} has no host region")

    def state(self, rip, rdi):
        cpu = bochscpu.cpu
        state = bochscpu.State()
        cpu.set_long_mode(state)
        cr4 = cpu.ControlRegister(state.cr4)
        cr4.OSFXSR = True
        cr4.OSXMMEXCPT = True
        cr4.OSXSAVE = True
        state.cr4 = int(cr4)
        state.cr3 = self.gpa(self.tables)
        state.xcr0 = 0xE7  # x87, SSE, AVX, opmask, ZMM upper halves, ZMM16-31
        state.mxcsr = 0x1F80
        state.rflags = 0x2
        state.rip = rip
        state.rdi = rdi
        # 16-byte aligned before the call, the return address (the `hlt`) pushed.
        rsp = (self.stack + (1 << 20) - 64) & ~0xF
        ctypes.c_uint64.from_address(rsp - 8).value = self.sentinel
        state.rsp = rsp - 8

        def segment(selector, attr, base=0):
            s = bochscpu.Segment()
            s.present = True
            s.selector = selector
            s.base = base
            s.limit = 0xFFFFFFFF
            s.attr = attr
            return s

        state.cs = segment(0x08, 0x209B)  # ring 0, 64-bit code
        data = segment(0x10, 0xC93)
        state.ds = state.ss = state.es = state.gs = data
        state.fs = segment(0x10, 0xC93, self.fs_base)
        return state

    def call(self, function, arg):
        """Runs `function(arg)` to its return; raises on any fault."""
        self.map_process()
        self.session.cpu.state = self.state(function, arg)
        self.fault = None

        def on_exception(sess, cpu_id, vector, error_code):
            self.fault = (vector, f"exception {vector} (error code {error_code}) at {sess.cpu.rip:#x}")
            sess.stop()

        def on_hlt(sess, cpu_id):
            sess.stop()

        hook = bochscpu.Hook()
        hook.exception = on_exception
        hook.hlt = on_hlt
        self.session.run([hook])
        if self.fault:
            raise Fault(*self.fault)
        rip = self.session.cpu.state.rip
        if rip != self.sentinel + 1:
            raise RuntimeError(f"stopped at {rip:#x}, not at the return")

    def cpuid(self, leaf, subleaf):
        """CPUID on the emulated CPU, from a few bytes of code."""
        code = host_alloc(PAGE)
        program = (b"\xb8" + leaf.to_bytes(4, "little") + b"\xb9" + subleaf.to_bytes(4, "little")
                   + b"\x0f\xa2"  # cpuid
                   + b"\x48\x89\x1f\x48\x89\x4f\x08\x48\x89\x57\x10"  # mov [rdi], rbx ...
                   + b"\xc3")
        ctypes.memmove(code, program, len(program))
        out = (ctypes.c_uint64 * 3)()
        self.call(code, ctypes.addressof(out))
        return [x & 0xFFFFFFFF for x in out]  # ebx, ecx, edx

    def eax_cpuid(self, leaf, subleaf):
        code = host_alloc(PAGE)
        program = (b"\xb8" + leaf.to_bytes(4, "little") + b"\xb9" + subleaf.to_bytes(4, "little")
                   + b"\x0f\xa2"  # cpuid
                   + b"\x48\x89\x07"  # mov [rdi], rax
                   + b"\xc3")
        ctypes.memmove(code, program, len(program))
        out = (ctypes.c_uint64 * 1)()
        self.call(code, ctypes.addressof(out))
        return out[0] & 0xFFFFFFFF


def main():
    faulthandler.enable()  # a crash in the emulator names the case's Python line on stderr
    lib = ctypes.CDLL(sys.argv[1])
    model = sys.argv[2]
    lib.emu_cases.restype = ctypes.c_size_t
    lib.emu_isa.restype = ctypes.c_size_t
    lib.emu_isa.argtypes = [ctypes.c_size_t]
    lib.emu_prepare.restype = ctypes.c_void_p
    lib.emu_prepare.argtypes = [ctypes.c_size_t]
    lib.emu_run_native.restype = ctypes.c_bool
    lib.emu_run_native.argtypes = [ctypes.c_void_p]
    lib.emu_check.restype = ctypes.c_bool
    lib.emu_check.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.emu_free.argtypes = [ctypes.c_void_p]
    lib.emu_fs_base.restype = ctypes.c_uint64

    emu = Emulator(lib.emu_fs_base(), model)
    ebx, ecx, _ = emu.cpuid(7, 0)
    features = {"avx2": ebx >> 5 & 1, "avx512f": ebx >> 16 & 1, "avx512bw": ebx >> 30 & 1,
                "avx512vl": ebx >> 31 & 1, "avx512vnni": ecx >> 11 & 1,
                "avxvnni": emu.eax_cpuid(7, 1) >> 4 & 1}
    avx512, avxvnni = MODEL_HAS[model]
    want = {name: int(avx512 if name.startswith("avx512") else avxvnni if name == "avxvnni"
                      else True)
            for name in features}
    if features != want:
        sys.exit(f"the emulated {model} has {features}, expected {want}: wrong `cpu.model` index?")
    print(f"emulated CPU: {model}, " + ", ".join(n for n, bit in features.items() if bit))
    emu.max_slots = 1 << ((emu.eax_cpuid(0x80000008, 0) & 0xFF) - 30)

    run = ctypes.cast(lib.emu_run, ctypes.c_void_p).value
    msg = ctypes.create_string_buffer(512)
    failures = 0
    for i in range(lib.emu_cases()):
        case = lib.emu_prepare(i)
        lacking = (lib.emu_isa(i) == 1 and not avxvnni) or (lib.emu_isa(i) == 2 and not avx512)
        try:
            try:
                emu.call(run, case)
                faulted = None
            except Fault as f:
                faulted = f
            ok = lib.emu_check(case, msg, len(msg))
            line = msg.value.decode()
            if lacking:
                # Every path built on `vpdpbusd` must stop at it; the row-major K-quant kernels
                # have no VNNI step of their own (the compiler may still pick other forms the
                # model lacks).
                name = line.split(":")[0]
                undefined = faulted is not None and faulted.vector == INVALID_OPCODE
                optional = "row-major" in name and ("Q4_K" in name or "Q6_K" in name)
                ok = undefined or (optional and faulted is None and ok)
                print(("" if ok else "FAIL ") + f"emulated {name}: "
                      + ("invalid opcode, as expected" if undefined
                         else f"ran ({faulted or 'no fault'})"))
            elif faulted:
                ok = False
                print(f"FAIL emulated {line.split(':')[0]}: {faulted}")
            else:
                print(("" if ok else "FAIL ") + "emulated " + line)
            failures += not ok
            if lib.emu_run_native(case):
                ok = lib.emu_check(case, msg, len(msg))
                print(("" if ok else "FAIL ") + "native   " + msg.value.decode())
                failures += not ok
        except RuntimeError as e:
            print(f"FAIL case {i}: {e}")
            failures += 1
        finally:
            lib.emu_free(case)
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # skips the binding's teardown, which reports leaks


if __name__ == "__main__":
    main()
