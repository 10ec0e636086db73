//! The CPU's peak rate of the kernels' inner product: 8-bit multiply-adds into 32-bit lanes
//! (`ByteDot::dpbusd` on 256-bit registers, the multi-row tiles' arithmetic) on data held in
//! registers, on every thread of the compute pool. The kernels' own rates read as a fraction
//! of it (`bench-model --breakdown`).

use super::Isa;

/// Independent accumulators: enough to cover `vpdpbusd`'s latency on two pipes.
const CHAINS: usize = 12;
/// Loop turns a task runs (each `CHAINS` products of 32 multiply-adds): about a millisecond
/// on a core that does two products a cycle.
const TURNS: u64 = 500_000;

/// 8-bit multiply-adds a second that the instruction set's inner product reaches on this
/// thread's compute pool, measured for about `secs`; `None` for the portable path. AMX is
/// measured as the AVX-512 VNNI products its kernels fall back to (its tiles are not).
pub fn int8_macs_per_s(isa: Isa, secs: f64) -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::time::Instant;

        let run: unsafe fn(u64) -> i32 = match isa {
            Isa::Scalar => return None,
            Isa::Avx2 => x86::turns_avx2,
            Isa::AvxVnni => x86::turns_avx_vnni,
            Isa::Avx512Vnni | Isa::Amx => x86::turns_avx512_vnni,
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
        Some((done * TURNS * CHAINS as u64 * 32) as f64 / elapsed)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (isa, secs);
        None
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::CHAINS;
    use crate::kernels::qmatmul::{Avx2Dot, Avx512VnniDot, AvxVnniDot, ByteDot};

    /// `turns` × `CHAINS` products of 32 multiply-adds each, on registers; returns a value
    /// that depends on every one, so nothing is optimised away.
    #[inline(always)]
    unsafe fn turns<D: ByteDot>(turns: u64) -> i32 {
        let q = _mm256_set1_epi8(std::hint::black_box(3));
        let x = _mm256_set1_epi8(std::hint::black_box(5));
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        for _ in 0..turns {
            for a in acc.iter_mut() {
                *a = D::dpbusd(*a, q, x);
            }
        }
        let mut all = _mm256_setzero_si256();
        for a in acc {
            all = _mm256_add_epi32(all, a);
        }
        _mm256_extract_epi32::<0>(all)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn turns_avx2(n: u64) -> i32 {
        turns::<Avx2Dot>(n)
    }

    #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
    pub(super) unsafe fn turns_avx_vnni(n: u64) -> i32 {
        turns::<AvxVnniDot>(n)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn turns_avx512_vnni(n: u64) -> i32 {
        turns::<Avx512VnniDot>(n)
    }
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
}
