//! The 256-bit tiles' inner passes, Q4_K's for four activation rows and Q6_K's for eight,
//! written in assembly for AVX-512 VNNI, whose EVEX encoding lets every `vpdpbusd` broadcast
//! its four activation bytes from memory (`{1to8}`) and use 32 registers.
//!
//! Written with intrinsics, the same pass compiled to code that loaded a pass's 32 broadcasts
//! ahead of their products, kept half of them in registers and stored the other half to the
//! stack, to be read back as memory operands, and kept the row sums on the stack too: three
//! memory operations for a broadcast instead of one. Register pressure decides what the
//! compiler hoists, so neither reordering the intrinsics nor fewer rows removed it. In
//! assembly the loop is the arithmetic alone: products of a 1536 × 8960 and an 8960 × 1536
//! Q4_K matrix by 64 and 512 activation rows ran 1.3–1.5× faster (alternated in one process).
//! Q6_K's pass (a sub-block for eight rows, each scale applied once to its 16 values) ran
//! 1.15–1.25× faster on the same shapes. The integer sums are the same (exact) and the float
//! step is the tiles' own, so the bits are too.
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
    pf: *const i8,
    pf_last: *const i8,
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

/// Group `$g`'s values (four of each weight row, as bytes) into `$v`: the low six bits of
/// byte `$j` of the group (sub-blocks `4n + j`, `j` < 3, from `{q}` = the `j`th 32 bytes) or,
/// for sub-block `4n + 3` (`{q}` = the first), the top two bits of all three.
macro_rules! q6k_values {
    (low, $v:literal, $g:literal) => {
        concat!(
            "vpandd ",
            $v,
            ", {m3f}, ymmword ptr [{q} + ",
            $g,
            " * 96]\n"
        )
    };
    (high, $v:literal, $g:literal) => {
        concat!(
            "vpsrlw ",
            $v,
            ", ymmword ptr [{q} + ",
            $g,
            " * 96], 6\n",
            "vpandd ",
            $v,
            ", ",
            $v,
            ", {m03}\n",
            "vpsrlw ymm20, ymmword ptr [{q} + ",
            $g,
            " * 96 + 32], 4\n",
            "vpternlogd ",
            $v,
            ", ymm20, {m0c}, 0xF8\n",
            "vpsrlw ymm20, ymmword ptr [{q} + ",
            $g,
            " * 96 + 64], 2\n",
            "vpternlogd ",
            $v,
            ", ymm20, {m30}, 0xF8\n",
        )
    };
}

/// Group `$g`'s products for the eight rows, values in `$v`, each row's sum in ymm24 + `r`.
macro_rules! q6k_group {
    ($v:literal, $g:literal) => {
        concat!(
            "vpdpbusd ymm24, ",
            $v,
            ", dword ptr ",
            q6k_row!(0, concat!($g, " * 4")),
            "{{1to8}}\n",
            "vpdpbusd ymm25, ",
            $v,
            ", dword ptr ",
            q6k_row!(1, concat!($g, " * 4")),
            "{{1to8}}\n",
            "vpdpbusd ymm26, ",
            $v,
            ", dword ptr ",
            q6k_row!(2, concat!($g, " * 4")),
            "{{1to8}}\n",
            "vpdpbusd ymm27, ",
            $v,
            ", dword ptr ",
            q6k_row!(3, concat!($g, " * 4")),
            "{{1to8}}\n",
            "vpdpbusd ymm28, ",
            $v,
            ", dword ptr ",
            q6k_row!(4, concat!($g, " * 4")),
            "{{1to8}}\n",
            "vpdpbusd ymm29, ",
            $v,
            ", dword ptr ",
            q6k_row!(5, concat!($g, " * 4")),
            "{{1to8}}\n",
            "vpdpbusd ymm30, ",
            $v,
            ", dword ptr ",
            q6k_row!(6, concat!($g, " * 4")),
            "{{1to8}}\n",
            "vpdpbusd ymm31, ",
            $v,
            ", dword ptr ",
            q6k_row!(7, concat!($g, " * 4")),
            "{{1to8}}\n",
        )
    };
}

/// One scale's 16 values (groups `4h..4h + 4`) of a Q6_K sub-block for the eight rows, its
/// two lines requested from `{pf}` + `$pf`: values, products, then the rows' sums times the
/// scale (`{sc}` + `$sc`: eight signed bytes) added to their totals.
macro_rules! q6k_half {
    ($kind:ident, $g0:literal, $g1:literal, $g2:literal, $g3:literal, $pf:literal, $sc:literal) => {
        concat!(
            "prefetcht0 byte ptr [{pf} + ",
            $pf,
            "]\n",
            q6k_values!($kind, "ymm16", $g0),
            q6k_values!($kind, "ymm17", $g1),
            q6k_values!($kind, "ymm18", $g2),
            q6k_values!($kind, "ymm19", $g3),
            "vpxord ymm24, ymm24, ymm24\n",
            "vpxord ymm25, ymm25, ymm25\n",
            "vpxord ymm26, ymm26, ymm26\n",
            "vpxord ymm27, ymm27, ymm27\n",
            "vpxord ymm28, ymm28, ymm28\n",
            "vpxord ymm29, ymm29, ymm29\n",
            "vpxord ymm30, ymm30, ymm30\n",
            "vpxord ymm31, ymm31, ymm31\n",
            q6k_group!("ymm16", $g0),
            q6k_group!("ymm17", $g1),
            "prefetcht0 byte ptr [{pf} + ",
            $pf,
            " + 64]\n",
            q6k_group!("ymm18", $g2),
            q6k_group!("ymm19", $g3),
            "vpmovsxbd ymm20, qword ptr [{sc} + ",
            $sc,
            "]\n",
            "vpmulld ymm24, ymm24, ymm20\n",
            "vpmulld ymm25, ymm25, ymm20\n",
            "vpmulld ymm26, ymm26, ymm20\n",
            "vpmulld ymm27, ymm27, ymm20\n",
            "vpmulld ymm28, ymm28, ymm20\n",
            "vpmulld ymm29, ymm29, ymm20\n",
            "vpmulld ymm30, ymm30, ymm20\n",
            "vpmulld ymm31, ymm31, ymm20\n",
            "vpaddd {s0}, {s0}, ymm24\n",
            "vpaddd {s1}, {s1}, ymm25\n",
            "vpaddd {s2}, {s2}, ymm26\n",
            "vpaddd {s3}, {s3}, ymm27\n",
            "vpaddd {s4}, {s4}, ymm28\n",
            "vpaddd {s5}, {s5}, ymm29\n",
            "vpaddd {s6}, {s6}, ymm30\n",
            "vpaddd {s7}, {s7}, ymm31\n",
        )
    };
}

/// A Q6_K pass over one sub-block (32 values, two scales) of a super-block for eight
/// activation rows: `sumi[r] += Σ_h scale_h · Σ_{g in h} q_g · x_r[4g..4g + 4]` in each weight
/// row's lane, the values taken as the intrinsics tile's `values` takes them (the low six bits
/// of the sub-block's own bytes, or for the fourth sub-block of each four, `high`, the top two
/// bits of all three). `q` points at the sub-block's first group (`BlockQ6Kx8::q`, its `j`th
/// 32 bytes unless `high`), `scales` at its two scales' eight bytes each, `x` at row 0's 32
/// activation bytes of the sub-block, the other rows `stride` bytes apart, and `pf` at the four
/// lines to request. A scale applies once to its four groups' sums, where the intrinsics tile
/// applies it to each pair (AVX2's 16-bit sums need that, 32-bit ones do not, and the integer
/// result is the same): `vpmulld` takes a product's slot on the multiply pipes.
///
/// # Safety
/// The CPU must support AVX-512 (F, BW, VL) and AVX-512 VNNI, and the pointers above address
/// readable memory (prefetches never fault).
#[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn q6k_sub8(
    high: bool,
    q: *const u8,
    scales: *const i8,
    x: *const i8,
    stride: usize,
    pf: *const i8,
    sumi: &mut [__m256i; 8],
) {
    use std::arch::x86_64::_mm256_set1_epi8;
    // Each kind uses some of the masks.
    q6k_sub8_asm!(
        q6k_half,
        high,
        (q, scales, x, stride, pf),
        sumi,
        "{m3f} {m03} {m0c} {m30}",
        m3f = in(ymm_reg) _mm256_set1_epi8(0x3F),
        m03 = in(ymm_reg) _mm256_set1_epi8(0x03),
        m0c = in(ymm_reg) _mm256_set1_epi8(0x0C),
        m30 = in(ymm_reg) _mm256_set1_epi8(0x30),
        out("zmm16") _,
        out("zmm17") _,
        out("zmm18") _,
        out("zmm19") _,
        out("zmm20") _,
        out("zmm24") _,
        out("zmm25") _,
        out("zmm26") _,
        out("zmm27") _,
        out("zmm28") _,
        out("zmm29") _,
        out("zmm30") _,
        out("zmm31") _,
    );
}
