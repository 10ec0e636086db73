//! The CPU's peak rate of the kernels' inner product: 8-bit multiply-adds on 256-bit registers
//! (the multi-row tiles' arithmetic: `vpdpbusd` into 32-bit lanes with VNNI; AVX2's `maddubs`
//! pairs summed in 16-bit lanes and widened once every eight products, as the Q4_K tile does)
//! on data held in registers, on every thread of the compute pool. The kernels' own rates read
//! as a fraction of it (`bench-model --breakdown`).

use super::Isa;

/// Independent accumulators: enough to cover `vpdpbusd`'s latency on two pipes.
const CHAINS: usize = 12;
/// AVX2's 16-bit sums (and as many 32-bit ones): a 16-bit add's one-cycle latency needs few,
/// and twice this many registers plus the operands fit AVX2's sixteen.
const CHAINS_DP16: usize = 6;
/// Products each AVX2 16-bit sum adds before it is widened (the Q4_K tile's sub-block).
const WIDEN_EVERY: u64 = 8;
/// Loop turns a task runs (each one product of 32 multiply-adds per chain): about a
/// millisecond on a core that does two products a cycle.
const TURNS: u64 = 500_000;

/// 8-bit multiply-adds a second that the instruction set's inner product reaches on this
/// thread's compute pool, measured for about `secs`; `None` for the portable path. AMX is
/// measured as the AVX-512 VNNI products its kernels fall back to (its tiles are not).
pub fn int8_macs_per_s(isa: Isa, secs: f64) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::time::Instant;

        let (run, chains): (unsafe fn(u64) -> i32, usize) = match isa {
            Isa::Scalar => return None,
            Isa::Avx2 => (x86::turns_avx2, CHAINS_DP16),
            Isa::AvxVnni => (x86::turns_avx_vnni, CHAINS),
            Isa::Avx512Vnni | Isa::Amx => (x86::turns_avx512_vnni, CHAINS),
        };
        if !isa.is_available() {
            return None;
        }
        let threads = crate::kernels::parallel::current_threads();
        // Fixed work per call so that every thread stays busy to the end: tasks are grabbed
        // dynamically and each is short.
        let tasks = (64 * threads).max(1);
        let sink = AtomicU64::new(0);
        let once = || {
            let started = Instant::now();
            crate::kernels::parallel::for_each_range(tasks, |range| {
                for _ in range {
                    // SAFETY: `isa` is available on this CPU (checked above).
                    let x = unsafe { run(TURNS) };
                    sink.fetch_xor(x as u64, Ordering::Relaxed);
                }
            });
            started.elapsed().as_secs_f64()
        };
        once();
        let (mut done, mut elapsed) = (0u64, 0f64);
        while elapsed < secs {
            elapsed += once();
            done += tasks as u64;
        }
        std::hint::black_box(sink.load(Ordering::Relaxed));
        Some((done * TURNS * chains as u64 * 32) as f64 / elapsed)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, secs);
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    use super::{CHAINS, CHAINS_DP16, WIDEN_EVERY};
    use crate::kernels::qmatmul::avx2::{dp16, widen};
    use crate::kernels::qmatmul::{Avx2Dot, Avx512VnniDot, AvxVnniDot, ByteDot};

    /// `$x` unchanged, but opaque to the compiler: every product takes an operand it cannot
    /// prove equal to another's, so none is hoisted out of the loop or shared between chains
    /// (AVX2's `maddubs` of loop-invariant operands otherwise is, leaving only the adds).
    /// No instruction is emitted. A macro, as the register class needs the caller's features.
    macro_rules! opaque {
        ($x:ident) => {
            asm!("/* {0} */", inout(ymm_reg) $x, options(nomem, nostack, preserves_flags))
        };
    }

    /// Lane 0 of the sums' total.
    #[inline(always)]
    unsafe fn lane0(acc: &[__m256i]) -> i32 {
        let all = acc
            .iter()
            .fold(_mm256_setzero_si256(), |all, a| _mm256_add_epi32(all, *a));
        _mm256_extract_epi32::<0>(all)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn turns_avx2(turns: u64) -> i32 {
        let mut q = _mm256_set1_epi8(std::hint::black_box(3));
        let x = _mm256_set1_epi8(std::hint::black_box(5));
        let mut acc = [_mm256_setzero_si256(); CHAINS_DP16];
        for _ in 0..turns / WIDEN_EVERY {
            let mut part = [_mm256_setzero_si256(); CHAINS_DP16];
            for _ in 0..WIDEN_EVERY {
                for p in part.iter_mut() {
                    opaque!(q);
                    *p = dp16::<Avx2Dot>(*p, q, x);
                }
            }
            for (a, p) in acc.iter_mut().zip(part) {
                *a = _mm256_add_epi32(*a, widen::<Avx2Dot>(p));
            }
        }
        lane0(&acc)
    }

    /// `$name(turns)`: `turns` × `CHAINS` products of 32 multiply-adds each into 32-bit lanes
    /// with `$dot`, on registers; returns a value that depends on every one, so nothing is
    /// optimised away.
    macro_rules! vnni_turns {
        ($name:ident, $features:literal, $dot:ty) => {
            #[target_feature(enable = $features)]
            pub(super) unsafe fn $name(turns: u64) -> i32 {
                let mut q = _mm256_set1_epi8(std::hint::black_box(3));
                let x = _mm256_set1_epi8(std::hint::black_box(5));
                let mut acc = [_mm256_setzero_si256(); CHAINS];
                for _ in 0..turns {
                    for a in acc.iter_mut() {
                        opaque!(q);
                        *a = <$dot>::dpbusd(*a, q, x);
                    }
                }
                lane0(&acc)
            }
        };
    }

    vnni_turns!(turns_avx_vnni, "avx2,fma,f16c,avxvnni", AvxVnniDot);
    vnni_turns!(
        turns_avx512_vnni,
        "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
        Avx512VnniDot
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fastest_instruction_set_reports_a_rate() {
        let isa = Isa::fastest();
        match int8_macs_per_s(isa, 0.01) {
            Some(rate) => assert!(rate.is_finite() && rate > 0.0, "{rate}"),
            None => assert_eq!(isa, Isa::Scalar),
        }
        assert_eq!(int8_macs_per_s(Isa::Scalar, 0.01), None);
    }

    /// Each loop does the products it is counted for: 3 · 5 four times to a 32-bit lane per
    /// product, in every chain and turn.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_loops_sum_every_product() {
        let turns = 3 * WIDEN_EVERY;
        let lane = |chains: usize| (turns as usize * chains * 4 * 15) as i32;
        if Isa::Avx2.is_available() {
            // SAFETY: AVX2 is available (checked).
            assert_eq!(unsafe { x86::turns_avx2(turns) }, lane(CHAINS_DP16));
        }
        if Isa::AvxVnni.is_available() {
            // SAFETY: AVX-VNNI is available (checked).
            assert_eq!(unsafe { x86::turns_avx_vnni(turns) }, lane(CHAINS));
        }
        if Isa::Avx512Vnni.is_available() {
            // SAFETY: AVX-512 VNNI is available (checked).
            assert_eq!(unsafe { x86::turns_avx512_vnni(turns) }, lane(CHAINS));
        }
    }
}
