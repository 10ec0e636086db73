//! The macros the interleaved formats' kernels are written with: dispatch by tile height,
//! one SIMD tile per instruction set, unrolled row loops, the pair-tile entry points, and the
//! row addresses of the Q6_K assembly passes.

/// Dispatches a tile of `sums.len()` activation rows to `$kernel::<[G,] T>(args.., sums)` for
/// each listed `T`.
macro_rules! dispatch_rows {
    ($kernel:ident, $args:tt, $sums:expr, [$($t:literal),*]) => {
        match $sums.len() {
            $($t => dispatch_rows!(@call ($kernel::<$t>), $args, $sums),)*
            n => unreachable!("no tile of {n} rows"),
        }
    };
    ($kernel:ident<$g:ty>, $args:tt, $sums:expr, [$($t:literal),*]) => {
        match $sums.len() {
            $($t => dispatch_rows!(@call ($kernel::<$g, $t>), $args, $sums),)*
            n => unreachable!("no tile of {n} rows"),
        }
    };
    (@call ($($f:tt)*), ($($arg:expr),*), $sums:expr) => {
        $($f)*($($arg,)* $sums)
    };
}

/// A format's SIMD tile `tile::<[G,] T>(isa, ..)` around its `#[inline(always)]` body
/// `$body::<[G,] T, D>` (`D` a [`ByteDot`](crate::kernels::qmatmul::ByteDot)): one entry point
/// compiled per instruction set, chosen by `isa`.
macro_rules! simd_tiles {
    ($body:ident, [$($g:ident: $bound:path)?], $block:ty, $act:ty) => {
        /// `T` activation rows × one group of eight weight rows, with `isa`'s instructions.
        ///
        /// # Safety
        /// The CPU must support `isa`, a SIMD one; `acts` holds `T · kb` blocks, `w` `kb`.
        #[inline(always)]
        pub(super) unsafe fn tile<$($g: $bound,)? const T: usize>(
            isa: crate::kernels::qmatmul::Isa,
            w: &[$block],
            acts: &[$act],
            kb: usize,
            sums: &mut [[f32; ROWS]],
        ) {
            use crate::kernels::qmatmul::Isa;
            match isa {
                Isa::Avx512Vnni | Isa::Amx => tile_avx512vnni::<$($g,)? T>(w, acts, kb, sums),
                Isa::AvxVnni => tile_avxvnni::<$($g,)? T>(w, acts, kb, sums),
                Isa::Avx2 => tile_avx2::<$($g,)? T>(w, acts, kb, sums),
                Isa::Scalar => unreachable!("the portable path has no SIMD tile"),
            }
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn tile_avx2<$($g: $bound,)? const T: usize>(
            w: &[$block],
            acts: &[$act],
            kb: usize,
            sums: &mut [[f32; ROWS]],
        ) {
            $body::<$($g,)? T, crate::kernels::qmatmul::Avx2Dot>(w, acts, kb, sums)
        }

        #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
        unsafe fn tile_avxvnni<$($g: $bound,)? const T: usize>(
            w: &[$block],
            acts: &[$act],
            kb: usize,
            sums: &mut [[f32; ROWS]],
        ) {
            $body::<$($g,)? T, crate::kernels::qmatmul::AvxVnniDot>(w, acts, kb, sums)
        }

        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn tile_avx512vnni<$($g: $bound,)? const T: usize>(
            w: &[$block],
            acts: &[$act],
            kb: usize,
            sums: &mut [[f32; ROWS]],
        ) {
            $body::<$($g,)? T, crate::kernels::qmatmul::Avx512VnniDot>(w, acts, kb, sums)
        }
    };
}

/// Runs `$body` with `$r` bound to each of `0..$rows` (at most 16), unrolled, so arrays indexed
/// by `$r` can live in registers.
#[cfg(target_arch = "x86_64")]
macro_rules! for_rows {
    ($rows:expr, |$r:ident| $body:block) => {
        for_rows!(@each $rows, $r, $body, 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15)
    };
    (@each $rows:expr, $r:ident, $body:block, $($n:literal)*) => {
        $(if $n < $rows {
            let $r: usize = $n;
            $body
        })*
    };
}

/// A format's pair tiles in its [`Interleaved`] impl: the flag `$flag` (`AMX` or `ZMM_PAIR`)
/// and the entry point `$name` (`amx_pair` or `zmm_pair`) calling `$tile` (same arguments).
macro_rules! pair_tiles {
    ($flag:ident, $name:ident, $tile:path) => {
        const $flag: bool = true;

        #[cfg(target_arch = "x86_64")]
        unsafe fn $name(
            w: [&[Self]; 2],
            acts: &[crate::kernels::qmatmul::interleaved::Act<Self>],
            kb: usize,
            rows: usize,
            stream: bool,
            sums: &mut [[f32; 16]; 16],
        ) {
            $tile(w, acts, kb, rows, stream, sums)
        }
    };
}

/// The rows of a Q6_K assembly pass (`evex`, `vex`): row `r`'s bytes at offset `$off` past the
/// pass's start, from the bases of rows 0 and 4 and the stride between rows (and three times
/// it).
macro_rules! q6k_row {
    (0, $off:expr) => {
        concat!("[{b} + ", $off, "]")
    };
    (1, $off:expr) => {
        concat!("[{b} + {st} + ", $off, "]")
    };
    (2, $off:expr) => {
        concat!("[{b} + {st} * 2 + ", $off, "]")
    };
    (3, $off:expr) => {
        concat!("[{b} + {st3} + ", $off, "]")
    };
    (4, $off:expr) => {
        concat!("[{b4} + ", $off, "]")
    };
    (5, $off:expr) => {
        concat!("[{b4} + {st} + ", $off, "]")
    };
    (6, $off:expr) => {
        concat!("[{b4} + {st} * 2 + ", $off, "]")
    };
    (7, $off:expr) => {
        concat!("[{b4} + {st3} + ", $off, "]")
    };
}

/// The `asm!` of a Q6_K pass (`evex`, `vex`) over one sub-block for eight activation rows:
/// `$half!` (the encoding's text for one scale's 16 values) for both scales, of the fourth
/// sub-block's kind where `$high` holds, with the operands both encodings bind (the sums
/// `$sumi`, and the rows as `q6k_row` addresses them), `$uses` naming in a comment the
/// operands one kind leaves unused, and the encoding's own operands after.
macro_rules! q6k_sub8_asm {
    (
        $half:ident, $high:expr, ($q:expr, $scales:expr, $x:expr, $stride:expr, $pf:expr),
        $sumi:expr, $uses:literal, $($own:tt)*
    ) => {{
        let [mut s0, mut s1, mut s2, mut s3, mut s4, mut s5, mut s6, mut s7] = *$sumi;
        macro_rules! pass {
            ($kind:ident) => {
                asm!(
                    concat!("/* ", $uses, " */"),
                    $half!($kind, 0, 1, 2, 3, 0, 0),
                    $half!($kind, 4, 5, 6, 7, 128, 8),
                    q = in(reg) $q,
                    sc = in(reg) $scales,
                    b = in(reg) $x,
                    b4 = in(reg) $x.wrapping_add(4 * $stride),
                    st = in(reg) $stride,
                    st3 = in(reg) 3 * $stride,
                    pf = in(reg) $pf,
                    s0 = inout(ymm_reg) s0,
                    s1 = inout(ymm_reg) s1,
                    s2 = inout(ymm_reg) s2,
                    s3 = inout(ymm_reg) s3,
                    s4 = inout(ymm_reg) s4,
                    s5 = inout(ymm_reg) s5,
                    s6 = inout(ymm_reg) s6,
                    s7 = inout(ymm_reg) s7,
                    $($own)*
                    options(nostack, readonly, preserves_flags),
                )
            };
        }
        if $high {
            pass!(high);
        } else {
            pass!(low);
        }
        *$sumi = [s0, s1, s2, s3, s4, s5, s6, s7];
    }};
}
