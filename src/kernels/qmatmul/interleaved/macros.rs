//! The macros the interleaved formats' kernels are written with: dispatch by tile height,
//! one SIMD tile per instruction set, unrolled row loops, and the pair-tile entry points.

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
