//! The 32-value formats through AMX tiles (see `qmatmul::amx`). One tile multiply takes one
//! block of up to 16 activation rows and the same block of 16 weight rows, two interleaved
//! groups unpacked to bytes ([`SimpleX8::amx_rows`]); its integer sums leave the tile unit
//! through a 1 KB store, and each activation row's 16 sums then take the AVX2 tile's float
//! arithmetic with 512-bit registers, so the product equals the VNNI kernels' bit for bit.
//! Each block needs its own float step (its own scales), which bounds the tile unit to one
//! 32-byte-deep multiply a block rather than its 64. The K-quants' tiles (in `q4k` and `q6k`,
//! next to their layouts) share this module's helpers.

use std::arch::x86_64::*;
use std::cell::UnsafeCell;

use super::block32_trait::SimpleX8;
use std::ops::Range;

use super::{prefetch_line, Interleaved, ROWS};
use crate::kernels::qmatmul::amx::{self, TILE_COLS, TILE_ROWS};
use crate::kernels::qmatmul::ActBlock;

/// 32 bytes from `a`, then 32 from `b`.
#[inline(always)]
pub(super) unsafe fn join(a: *const u8, b: *const u8) -> __m512i {
    let low = _mm512_castsi256_si512(_mm256_loadu_si256(a as *const __m256i));
    _mm512_inserti64x4::<1>(low, _mm256_loadu_si256(b as *const __m256i))
}

/// The weight tile's rows for two groups' 4-bit values (as `interleave_nibbles` lays them
/// out): row `g < 4` is the low nibbles of their 32-byte group `g` (values `4g..4g + 4` of
/// each weight row), row `g + 4` the high ones (values `16 + 4g..`).
#[inline(always)]
pub(super) unsafe fn nibble_rows(qs: [&[u8; 128]; 2]) -> [__m512i; 8] {
    let m4 = _mm512_set1_epi8(0x0F);
    let mut rows = [_mm512_setzero_si512(); 8];
    for g in 0..4 {
        let raw = join(qs[0].as_ptr().add(32 * g), qs[1].as_ptr().add(32 * g));
        rows[g] = _mm512_and_si512(raw, m4);
        rows[g + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
    }
    rows
}

/// Eight bytes from `a`, then eight from `b` (a K-quant field of eight bytes a sub-block, one
/// byte per weight row, of the two groups of a pair; or one group's twice, for the two halves
/// of a 512-bit one-row kernel's register).
#[inline(always)]
pub(super) unsafe fn bytes8(a: *const u8, b: *const u8) -> __m128i {
    let half = |p: *const u8| std::ptr::read_unaligned(p as *const i64);
    _mm_set_epi64x(half(b), half(a))
}

/// Requests lines `lines` (counted as [`prefetch_line`] counts) of both blocks of a pair; with
/// `stream` (a product whose rows fit one tile, so each weight comes from memory once) as the
/// one-row kernels do, into L1 from 3 KB ahead and into L2 8 KB further
/// ([`zmm::prefetch_row_line`](super::avx512_row::prefetch_row_line)). Decode batches of 6 to 16
/// decoded 3–17 % faster that way (the 1.5B's batches of 8 at 365–373 % of the batch-1
/// roofline against 316–318, the 0.5B's at 384–388 against 356–364; two alternated rounds);
/// prefills (16-row tiles over weights that stay in L2 between them) 1–6 % slower, so they keep
/// the format's requests.
#[inline(always)]
pub(super) unsafe fn prefetch_pair<P: Interleaved>(
    pair: [&P; 2],
    lines: Range<usize>,
    stream: bool,
) {
    for line in lines {
        if stream {
            super::avx512_row::prefetch_row_line(pair[0], line);
            super::avx512_row::prefetch_row_line(pair[1], line);
        } else {
            prefetch_line(pair[0], line);
            prefetch_line(pair[1], line);
        }
    }
}

/// `sumi[r] += sums[r] · scales`, lane by lane in 32 bits, for `r < rows`: a K-quant
/// sub-block's products times its integer scales.
#[inline(always)]
pub(super) unsafe fn add_scaled(
    sumi: &mut [__m512i; TILE_ROWS],
    sums: &[[i32; TILE_COLS]; TILE_ROWS],
    scales: __m512i,
    rows: usize,
) {
    for_rows!(rows, |r| {
        let dots = _mm512_load_si512(sums[r].as_ptr() as *const __m512i);
        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(dots, scales));
    });
}

/// Writes the first `rows` accumulators to `sums`.
#[inline(always)]
pub(super) unsafe fn store_rows(
    acc: &[__m512; TILE_ROWS],
    rows: usize,
    sums: &mut [[f32; TILE_COLS]; TILE_ROWS],
) {
    for (s, a) in sums.iter_mut().zip(acc).take(rows) {
        _mm512_storeu_ps(s.as_mut_ptr(), *a);
    }
}

/// A pair tile's working memory: the weight tiles of up to eight blocks (`b`) and the sums of
/// up to 16 products (`c`). One per thread, zeroed once (zeroing it every call cost as much as
/// a block's multiply).
#[repr(C, align(64))]
pub(super) struct Scratch {
    pub(super) b: [[[u8; 64]; 8]; 8],
    pub(super) c: [[[i32; TILE_COLS]; TILE_ROWS]; 16],
}

thread_local! {
    static SCRATCH: UnsafeCell<Scratch> = const {
        UnsafeCell::new(Scratch {
            b: [[[0; 64]; 8]; 8],
            c: [[[0; TILE_COLS]; TILE_ROWS]; 16],
        })
    };
}

/// This thread's [`Scratch`].
///
/// # Safety
/// The reference must be gone before the thread asks again: a pair tile takes it once and
/// calls no other.
#[inline(always)]
pub(super) unsafe fn scratch() -> &'static mut Scratch {
    &mut *SCRATCH.with(|s| s.get())
}

/// 16 f16 values, eight from each of `pair`, as f32.
#[inline(always)]
pub(super) unsafe fn halves(pair: [&[half::f16; ROWS]; 2]) -> __m512 {
    let half = |h: &[half::f16; ROWS]| _mm_loadu_si128(h.as_ptr() as *const __m128i);
    _mm512_cvtph_ps(_mm256_set_m128i(half(pair[1]), half(pair[0])))
}

/// Blocks whose weight tiles are unpacked, then multiplied, then scaled as three passes: a
/// tile load waits for the stores it reads to complete, and the vector loads for the tile
/// store they read, so a block done start to end idles through both.
const STRETCH: usize = 8;

/// `sums[r][c]` for `r < rows` = activation row `r` (`kb` blocks from `acts[r · kb]`) · weight
/// row `c` of the pair `w` (`w[0]`'s eight rows, then `w[1]`'s); `stream` as
/// [`prefetch_pair`] takes it.
///
/// # Safety
/// It runs inside [`amx::with_tiles`] for `rows` rows, and the CPU has AVX-512 (F, BW, VL);
/// `acts` holds `rows · kb` blocks, each of `w` `kb`; `rows` is 1 to 16.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn pair_tile<S: SimpleX8>(
    w: [&[S]; 2],
    acts: &[ActBlock],
    kb: usize,
    rows: usize,
    stream: bool,
    sums: &mut [[f32; TILE_COLS]; TILE_ROWS],
) {
    let Scratch { b, c } = scratch();
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    let stride = kb * std::mem::size_of::<ActBlock>();
    let lines = std::mem::size_of::<S>().div_ceil(64);
    for k0 in (0..kb).step_by(STRETCH) {
        let n = STRETCH.min(kb - k0);
        for (j, b) in b.iter_mut().enumerate().take(n) {
            let pair = [w[0].get_unchecked(k0 + j), w[1].get_unchecked(k0 + j)];
            prefetch_pair(pair, 0..lines, stream);
            for (row, v) in b.iter_mut().zip(S::amx_rows(pair)) {
                _mm512_store_si512(row.as_mut_ptr() as *mut __m512i, v);
            }
        }
        for (j, (b, c)) in b.iter().zip(c.iter_mut()).enumerate().take(n) {
            let a = acts.get_unchecked(k0 + j).qs.as_ptr();
            amx::product(j, a, stride, b.as_ptr(), S::SIGNED, c);
        }
        for (j, c) in c.iter().enumerate().take(n) {
            let k = k0 + j;
            let pair = [w[0].get_unchecked(k), w[1].get_unchecked(k)];
            let d = halves([pair[0].d(), pair[1].d()]);
            let m = offsets(pair);
            for_rows!(rows, |r| {
                let a = acts.get_unchecked(r * kb + k);
                let dots = _mm512_load_si512(c[r].as_ptr() as *const __m512i);
                block_step(d, m, a, dots, S::OFFSET, &mut acc[r]);
            });
        }
    }
    store_rows(&acc, rows, sums);
}

/// The pair's 16 offsets, for the formats that have them.
#[inline(always)]
unsafe fn offsets<S: SimpleX8>(pair: [&S; 2]) -> Option<__m512> {
    match (pair[0].m(), pair[1].m()) {
        (Some(m0), Some(m1)) => Some(halves([m0, m1])),
        _ => None,
    }
}

/// A block's float step in 16 lanes (`block32_trait::add_block`'s): `acc += d · a.d · (dots -
/// offset · a.sum)`, plus `m · a.s` where the format has offsets.
#[inline(always)]
unsafe fn block_step(
    d: __m512,
    m: Option<__m512>,
    a: &ActBlock,
    mut dots: __m512i,
    offset: i32,
    acc: &mut __m512,
) {
    if offset != 0 {
        dots = _mm512_sub_epi32(dots, _mm512_set1_epi32(offset * a.sum));
    }
    let scale = _mm512_mul_ps(d, _mm512_set1_ps(a.d));
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), scale, *acc);
    if let Some(m) = m {
        *acc = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s), *acc);
    }
}

/// As [`pair_tile`], on AVX-512 VNNI's 512-bit registers (no AMX): each block of the pair is
/// unpacked to bytes once and reused by every activation row of the tile, four at a time;
/// each `vpdpbusd` multiplies 16 weight rows by one row's four activation bytes, broadcast
/// from memory. Q8_0's signed values take 128 more (their products 128 times the block's
/// activation sum more, taken off as the other formats' offsets are), so every format
/// multiplies unsigned bytes; the integer sums are exact, so the bits are `pair_tile`'s.
///
/// # Safety
/// The CPU has AVX-512 (F, BW, VL) and AVX-512 VNNI; `acts` holds `rows · kb` blocks, each
/// of `w` `kb`; `rows` is 1 to 16.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn zmm_pair_tile<S: SimpleX8>(
    w: [&[S]; 2],
    acts: &[ActBlock],
    kb: usize,
    rows: usize,
    stream: bool,
    sums: &mut [[f32; TILE_COLS]; TILE_ROWS],
) {
    let Scratch { b, .. } = scratch();
    let mut acc = [_mm512_setzero_ps(); TILE_ROWS];
    let lines = std::mem::size_of::<S>().div_ceil(64);
    let (flip, offset) = match S::SIGNED {
        true => (_mm512_set1_epi8(i8::MIN), S::OFFSET + 128),
        false => (_mm512_setzero_si512(), S::OFFSET),
    };
    for k0 in (0..kb).step_by(STRETCH) {
        let n = STRETCH.min(kb - k0);
        for (j, b) in b.iter_mut().enumerate().take(n) {
            let pair = [w[0].get_unchecked(k0 + j), w[1].get_unchecked(k0 + j)];
            prefetch_pair(pair, 0..lines, stream);
            for (row, v) in b.iter_mut().zip(S::amx_rows(pair)) {
                _mm512_store_si512(row.as_mut_ptr() as *mut __m512i, _mm512_xor_si512(v, flip));
            }
        }
        for (j, b) in b.iter().enumerate().take(n) {
            let k = k0 + j;
            let pair = [w[0].get_unchecked(k), w[1].get_unchecked(k)];
            let (d, m) = (halves([pair[0].d(), pair[1].d()]), offsets(pair));
            let mut r = 0;
            while r < rows {
                let step =
                    |a: &ActBlock, dots, acc: &mut __m512| block_step(d, m, a, dots, offset, acc);
                r += match rows - r {
                    1 => zmm_rows::<1>(b, acts, kb, k, r, step, &mut acc),
                    2 => zmm_rows::<2>(b, acts, kb, k, r, step, &mut acc),
                    3 => zmm_rows::<3>(b, acts, kb, k, r, step, &mut acc),
                    _ => zmm_rows::<4>(b, acts, kb, k, r, step, &mut acc),
                };
            }
        }
    }
    store_rows(&acc, rows, sums);
}

/// Block `k`'s products for activation rows `r0..r0 + T` from its unpacked values `b`, each
/// ended by `step`; returns `T`. Even and odd groups of four values in separate sums, so `2T`
/// chains overlap `vpdpbusd`'s latency.
#[inline(always)]
unsafe fn zmm_rows<const T: usize>(
    b: &[[u8; 64]; 8],
    acts: &[ActBlock],
    kb: usize,
    k: usize,
    r0: usize,
    step: impl Fn(&ActBlock, __m512i, &mut __m512),
    acc: &mut [__m512; TILE_ROWS],
) -> usize {
    let a: [&ActBlock; T] = std::array::from_fn(|i| acts.get_unchecked((r0 + i) * kb + k));
    let mut part = [[_mm512_setzero_si512(); T]; 2];
    for (g, values) in b.iter().enumerate() {
        let wv = _mm512_load_si512(values.as_ptr() as *const __m512i);
        for i in 0..T {
            let x = std::ptr::read_unaligned(a[i].qs.as_ptr().add(4 * g) as *const i32);
            part[g % 2][i] = _mm512_dpbusd_epi32(part[g % 2][i], wv, _mm512_set1_epi32(x));
        }
    }
    for i in 0..T {
        step(
            a[i],
            _mm512_add_epi32(part[0][i], part[1][i]),
            &mut acc[r0 + i],
        );
    }
    T
}
