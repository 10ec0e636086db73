//! Q6_K's tile pass for eight activation rows on AVX2 alone (VEX encoding, 16 vector
//! registers), in assembly: `evex`'s pass for machines without AVX-512, with `vpmaddubsw` and
//! 16-bit sums where that one has `vpdpbusd`.
//!
//! Written with intrinsics, the tile kept its eight row addresses on the stack and reloaded one
//! before each broadcast, and one row's sum as well: with 15 general registers and 16 vector
//! ones, the compiler hoisted loads ahead of their products and ran out of both. Here the rows
//! are addressed from two bases and the stride, the pass holds its eight sums, two groups'
//! values and the scale in registers, and each activation broadcast is one load. A packed Q6_K
//! matrix by 64 and 512 activation rows ran 1.18–1.22× faster (8960 × 1536 and 1536 × 8960,
//! one and two threads, alternated in one process). The integer sums are the intrinsics
//! tile's (two groups' products in 16 bits, widened by `vpmaddwd` with the scale), and the
//! float step is its own, so the bits are too.
use std::arch::asm;
use std::arch::x86_64::__m256i;

/// Each byte of the masks that assemble Q6_K's fourth sub-block value from three bit pairs.
#[repr(C, align(32))]
struct Masks([[u8; 32]; 3]);

static Q6K_MASKS: Masks = Masks([[0x03; 32], [0x0C; 32], [0x30; 32]]);

/// Eight scale bytes at `$sc + $off` into `$s`, each sign-extended to 16 bits in both halves
/// of its row's 32-bit lane (as `vpmaddwd` takes them), `$t` a scratch register.
macro_rules! scale_pairs {
    ($s:literal, $t:literal, $sc:literal, $off:literal) => {
        concat!(
            "vpmovsxbd ",
            $s,
            ", qword ptr [",
            $sc,
            " + ",
            $off,
            "]\n",
            "vpslld ",
            $t,
            ", ",
            $s,
            ", 16\n",
            "vpblendw ",
            $s,
            ", ",
            $s,
            ", ",
            $t,
            ", 0xAA\n",
        )
    };
}

/// Group `$g`'s values (four of each weight row, as bytes) into `$v`, as `evex`'s passes take
/// them: the low six bits of the sub-block's own bytes, or (`high`) the top two bits of all
/// three, the masks from `{mk}` and `{t}` a scratch register.
macro_rules! q6k_values {
    (low, $v:literal, $g:literal) => {
        concat!("vpand ", $v, ", {m3f}, ymmword ptr [{q} + ", $g, " * 96]\n")
    };
    (high, $v:literal, $g:literal) => {
        concat!(
            "vmovdqa ",
            $v,
            ", ymmword ptr [{q} + ",
            $g,
            " * 96]\n",
            "vpsrlw ",
            $v,
            ", ",
            $v,
            ", 6\n",
            "vpand ",
            $v,
            ", ",
            $v,
            ", ymmword ptr [{mk}]\n",
            "vmovdqa {t}, ymmword ptr [{q} + ",
            $g,
            " * 96 + 32]\n",
            "vpsrlw {t}, {t}, 4\n",
            "vpand {t}, {t}, ymmword ptr [{mk} + 32]\n",
            "vpor ",
            $v,
            ", ",
            $v,
            ", {t}\n",
            "vmovdqa {t}, ymmword ptr [{q} + ",
            $g,
            " * 96 + 64]\n",
            "vpsrlw {t}, {t}, 2\n",
            "vpand {t}, {t}, ymmword ptr [{mk} + 64]\n",
            "vpor ",
            $v,
            ", ",
            $v,
            ", {t}\n",
        )
    };
}

/// Row `$r`'s products with the values of groups `$g0` (in `{v0}`) and `$g1` (`{v1}`): the
/// two add up in 16 bits (at most 2 · 2 · 63 · 128 = 32 256), times the scale (`{sc}`), to the
/// row's total `$s`.
macro_rules! q6k_pair_row {
    ($r:tt, $s:literal, $g0:literal, $g1:literal) => {
        concat!(
            "vpbroadcastd {t}, dword ptr ",
            q6k_row!($r, concat!($g0, " * 4")),
            "\n",
            "vpmaddubsw {t}, {v0}, {t}\n",
            "vpbroadcastd {u}, dword ptr ",
            q6k_row!($r, concat!($g1, " * 4")),
            "\n",
            "vpmaddubsw {u}, {v1}, {u}\n",
            "vpaddw {t}, {t}, {u}\n",
            "vpmaddwd {t}, {t}, {scale}\n",
            "vpaddd ",
            $s,
            ", ",
            $s,
            ", {t}\n",
        )
    };
}

/// Groups `$g0` and `$g1` of a Q6_K sub-block for the eight rows.
macro_rules! q6k_pair {
    ($kind:ident, $g0:literal, $g1:literal) => {
        concat!(
            q6k_values!($kind, "{v0}", $g0),
            q6k_values!($kind, "{v1}", $g1),
            q6k_pair_row!(0, "{s0}", $g0, $g1),
            q6k_pair_row!(1, "{s1}", $g0, $g1),
            q6k_pair_row!(2, "{s2}", $g0, $g1),
            q6k_pair_row!(3, "{s3}", $g0, $g1),
            q6k_pair_row!(4, "{s4}", $g0, $g1),
            q6k_pair_row!(5, "{s5}", $g0, $g1),
            q6k_pair_row!(6, "{s6}", $g0, $g1),
            q6k_pair_row!(7, "{s7}", $g0, $g1),
        )
    };
}

/// One scale's 16 values (groups `4h..4h + 4`) of a Q6_K sub-block for the eight rows, its two
/// lines requested from `{pf}` + `$pf`, the scale at `{sc}` + `$sc`.
macro_rules! q6k_half {
    ($kind:ident, $g0:literal, $g1:literal, $g2:literal, $g3:literal, $pf:literal, $sc:literal) => {
        concat!(
            "prefetcht0 byte ptr [{pf} + ",
            $pf,
            "]\n",
            scale_pairs!("{scale}", "{t}", "{sc}", $sc),
            q6k_pair!($kind, $g0, $g1),
            "prefetcht0 byte ptr [{pf} + ",
            $pf,
            " + 64]\n",
            q6k_pair!($kind, $g2, $g3),
        )
    };
}

/// A Q6_K pass over one sub-block (32 values, two scales) of a super-block for eight
/// activation rows, as [`evex::q6k_sub8`](super::evex::q6k_sub8) with the same arguments,
/// each scale applied to a pair of groups as the intrinsics tile applies it (AVX2's 16-bit
/// sums hold two groups' products, not four).
///
/// # Safety
/// The CPU must support AVX2, and the pointers address readable memory as `evex::q6k_sub8`
/// says, `q` 32-byte aligned (prefetches never fault).
#[target_feature(enable = "avx2")]
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
    // The low sub-blocks use the register mask, the high one the masks in memory.
    q6k_sub8_asm!(
        q6k_half,
        high,
        (q, scales, x, stride, pf),
        sumi,
        "{m3f} {mk}",
        mk = in(reg) Q6K_MASKS.0.as_ptr(),
        m3f = in(ymm_reg) _mm256_set1_epi8(0x3F),
        scale = out(ymm_reg) _,
        v0 = out(ymm_reg) _,
        v1 = out(ymm_reg) _,
        t = out(ymm_reg) _,
        u = out(ymm_reg) _,
    );
}
