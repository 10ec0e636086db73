//! The 256-bit tiles' inner passes for four activation rows, written in assembly for AVX-512
//! VNNI, whose EVEX encoding lets every `vpdpbusd` broadcast its four activation bytes from
//! memory (`{1to8}`) into one of 32 registers.
//!
//! Written with intrinsics, the same pass compiled to code that loaded a pass's 32 broadcasts
//! ahead of their products, kept half of them in registers and stored the other half to the
//! stack, to be read back as memory operands, and kept the row sums on the stack too: three
//! memory operations for a broadcast instead of one. Register pressure decides what the
//! compiler hoists, so neither reordering the intrinsics nor fewer rows removed it. In
//! assembly the loop is the arithmetic alone: products of a 1536 × 8960 and an 8960 × 1536
//! Q4_K matrix by 64 and 512 activation rows ran 1.3–1.5× faster (alternated in one process).
//! The integer sums are the same (exact) and the float step is the tiles' own, so the bits
//! are too.
use std::arch::asm;
use std::arch::x86_64::__m256i;

/// A Q4_K pass over sub-blocks `2p` and `2p + 1` of one super-block for four activation rows:
/// `sumi[r] += Σ_h scales_h · Σ q_h · x_{r,h}` in each weight row's lane, where `w` points at
/// the pass's 256 bytes of interleaved `qs` (low nibbles sub-block `2p`, high `2p + 1`),
/// `a[r]` at row `r`'s 64 activation bytes of the two sub-blocks, `scales` at the two
/// sub-blocks' eight row scales each (16 bytes), and `m4` holds `0x0F` in every byte.
/// Every product's sum for one lane and sub-block is its own chain, eight in all, so
/// `vpdpbusd`'s latency overlaps. `pf` and `pf_last` are the pass's lines to request into the
/// first-level cache, four from `pf` and the one at `pf_last`, spread over its eight loads as
/// the intrinsics tile spreads them (`q4k::avx2::prefetch_slot`).
///
/// # Safety
/// The CPU must support AVX-512 (F, BW, VL) and AVX-512 VNNI; `w`, `a` and `scales` must
/// point at readable memory of the sizes above (prefetches never fault).
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn q4k_pass4(
    w: *const u8,
    a: [*const i8; 4],
    scales: *const u8,
    m4: __m256i,
    pf: *const u8,
    pf_last: *const u8,
    sumi: &mut [__m256i; 4],
) {
    // One group of four values: a 32-byte load, its low nibbles times each row's four bytes of
    // sub-block `2p`, its high nibbles times those of `2p + 1`; `$pf`, a request or nothing.
    macro_rules! group {
        ($g:literal, $pf:literal) => {
            concat!(
                $pf,
                "vmovdqu64 {bits}, ymmword ptr [{w} + ",
                $g,
                " * 32]\n",
                "vpandd {q}, {bits}, {m4}\n",
                "vpdpbusd {p0}, {q}, dword ptr [{a0} + ",
                $g,
                " * 4]{{1to8}}\n",
                "vpdpbusd {p1}, {q}, dword ptr [{a1} + ",
                $g,
                " * 4]{{1to8}}\n",
                "vpdpbusd {p2}, {q}, dword ptr [{a2} + ",
                $g,
                " * 4]{{1to8}}\n",
                "vpdpbusd {p3}, {q}, dword ptr [{a3} + ",
                $g,
                " * 4]{{1to8}}\n",
                "vpsrlw {bits}, {bits}, 4\n",
                "vpandd {bits}, {bits}, {m4}\n",
                "vpdpbusd {p4}, {bits}, dword ptr [{a0} + 32 + ",
                $g,
                " * 4]{{1to8}}\n",
                "vpdpbusd {p5}, {bits}, dword ptr [{a1} + 32 + ",
                $g,
                " * 4]{{1to8}}\n",
                "vpdpbusd {p6}, {bits}, dword ptr [{a2} + 32 + ",
                $g,
                " * 4]{{1to8}}\n",
                "vpdpbusd {p7}, {bits}, dword ptr [{a3} + 32 + ",
                $g,
                " * 4]{{1to8}}\n",
            )
        };
    }
    let [mut s0, mut s1, mut s2, mut s3] = *sumi;
    asm!(
        "vpxord {p0}, {p0}, {p0}",
        "vpxord {p1}, {p1}, {p1}",
        "vpxord {p2}, {p2}, {p2}",
        "vpxord {p3}, {p3}, {p3}",
        "vpxord {p4}, {p4}, {p4}",
        "vpxord {p5}, {p5}, {p5}",
        "vpxord {p6}, {p6}, {p6}",
        "vpxord {p7}, {p7}, {p7}",
        group!(0, "prefetcht0 byte ptr [{pf}]\n"),
        group!(1, ""),
        group!(2, "prefetcht0 byte ptr [{pf} + 64]\n"),
        group!(3, ""),
        group!(4, "prefetcht0 byte ptr [{pf} + 128]\n"),
        group!(5, "prefetcht0 byte ptr [{pf} + 192]\n"),
        group!(6, ""),
        group!(7, "prefetcht0 byte ptr [{pf_last}]\n"),
        "vpmovzxbd {q}, qword ptr [{scales}]",
        "vpmulld {p0}, {p0}, {q}",
        "vpmulld {p1}, {p1}, {q}",
        "vpmulld {p2}, {p2}, {q}",
        "vpmulld {p3}, {p3}, {q}",
        "vpmovzxbd {q}, qword ptr [{scales} + 8]",
        "vpmulld {p4}, {p4}, {q}",
        "vpmulld {p5}, {p5}, {q}",
        "vpmulld {p6}, {p6}, {q}",
        "vpmulld {p7}, {p7}, {q}",
        "vpaddd {s0}, {s0}, {p0}",
        "vpaddd {s1}, {s1}, {p1}",
        "vpaddd {s2}, {s2}, {p2}",
        "vpaddd {s3}, {s3}, {p3}",
        "vpaddd {s0}, {s0}, {p4}",
        "vpaddd {s1}, {s1}, {p5}",
        "vpaddd {s2}, {s2}, {p6}",
        "vpaddd {s3}, {s3}, {p7}",
        w = in(reg) w,
        a0 = in(reg) a[0],
        a1 = in(reg) a[1],
        a2 = in(reg) a[2],
        a3 = in(reg) a[3],
        scales = in(reg) scales,
        pf = in(reg) pf,
        pf_last = in(reg) pf_last,
        m4 = in(ymm_reg) m4,
        s0 = inout(ymm_reg) s0,
        s1 = inout(ymm_reg) s1,
        s2 = inout(ymm_reg) s2,
        s3 = inout(ymm_reg) s3,
        bits = out(ymm_reg) _,
        q = out(ymm_reg) _,
        p0 = out(ymm_reg) _,
        p1 = out(ymm_reg) _,
        p2 = out(ymm_reg) _,
        p3 = out(ymm_reg) _,
        p4 = out(ymm_reg) _,
        p5 = out(ymm_reg) _,
        p6 = out(ymm_reg) _,
        p7 = out(ymm_reg) _,
        options(nostack, readonly, preserves_flags),
    );
    *sumi = [s0, s1, s2, s3];
}
