//! The interleaved kernels (`interleaved`): every format against the dense reference, SiLU·gate fused
//! into gate/up, AMX against AVX-512 VNNI, and a row's product the same bits on every path.

use rand::{Rng, SeedableRng};

use super::*;

/// Every format with rows interleaved eight at a time, against the same reference as the ggml
/// layout, through every instruction set; row counts are multiples of 8 and batches pass
/// through every tile height and leave tails.
fn check_packed<P: Interleaved>() {
    type Act<P> = <<P as Interleaved>::Source as WeightBlock>::Act;
    let name = <P::Source as WeightBlock>::NAME;
    for (rows, blocks, batch) in [
        (8, 1, 1),
        (16, 2, 17),
        (24, 3, 7),
        (64, 4, 16),
        (8, 2, 11),
        (16, 28, 5),
        (8, 1, 0),
    ] {
        let cols = blocks * Act::<P>::LEN;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((rows * 131 + cols + batch) as u64);
        let bytes = random_blocks::<P::Source>(rows * blocks, &mut rng);
        let m = PackedMatrix::<P>::from_bytes(rows, cols, &bytes).unwrap();
        let x: Vec<f32> = (0..batch * cols)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let mut acts = vec![Act::<P>::ZERO; batch * blocks];
        for (row, a) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(blocks)) {
            quantize_row(row, a);
        }
        // Rows read back from the interleaved copy (the tied embedding's lookup) are
        // candle's dequantization of the ggml rows, bit for bit.
        let dense = dequantized::<P::Source>(&bytes, rows, cols);
        let mut row = vec![f32::NAN; cols];
        for (r, want) in dense.chunks_exact(cols).enumerate() {
            assert!(m.dequantize_row(r, &mut row));
            assert_eq!(
                row, want,
                "packed {name} {rows}x{cols}: row {r} dequantized"
            );
        }
        let (want, mag) = reference::<P::Source>(&bytes, rows, cols, &acts, batch);
        for isa in Isa::available() {
            let mut out = vec![f32::NAN; batch * rows];
            m.matmul_with(isa, &x, &mut out);
            for (i, (&got, &w)) in out.iter().zip(&want).enumerate() {
                let tol = 1e-5 * mag[i] + 1e-4;
                assert!(
                    (got as f64 - w).abs() < tol,
                    "packed {name} {isa:?} {rows}x{cols} b{batch} [{i}]: {got} vs {w}"
                );
            }
            // The vector the model's layers take is the same product (the kernels write it
            // without zeroing it first; test builds fill it with NaN, so a value left
            // unwritten fails here).
            if isa == Isa::best() {
                let fresh = m.matmul_vec(&x);
                assert!(
                    same_bits(&fresh, &out),
                    "packed {name} b{batch}: matmul_vec"
                );
            }
        }
    }
}

/// The gate/up pair with SiLU·gate applied in the kernel against the two products through
/// [`PackedMatrix`] (checked above against the reference) and then
/// [`silu_mul`](crate::kernels::silu_mul): equal bit for bit, through every instruction set.
fn check_gated<P: Interleaved>() {
    let name = <P::Source as WeightBlock>::NAME;
    let len = <<P::Source as WeightBlock>::Act as ActFormat>::LEN;
    // The last shape spans several weight slices (each slice's pairs written at its own
    // offset).
    for (rows, blocks, batch) in [
        (8, 1, 1),
        (24, 3, 17),
        (72, 2, 7),
        (16, 5, 0),
        (80, 1, 9),
        (256, 8, 3),
    ] {
        let cols = blocks * len;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((rows * 7 + cols + batch) as u64);
        let gate = random_blocks::<P::Source>(rows * blocks, &mut rng);
        let up = random_blocks::<P::Source>(rows * blocks, &mut rng);
        let gated = GatedPacked::<P>::from_bytes(rows, cols, &gate, &up).unwrap();
        let (g, u) = (
            PackedMatrix::<P>::from_bytes(rows, cols, &gate).unwrap(),
            PackedMatrix::<P>::from_bytes(rows, cols, &up).unwrap(),
        );
        assert_eq!((gated.rows(), gated.cols()), (rows, cols));
        assert_eq!(gated.storage_bytes(), g.storage_bytes() + u.storage_bytes());
        let x: Vec<f32> = (0..batch * cols)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        for isa in Isa::available() {
            let (mut gx, mut ux) = (vec![0f32; batch * rows], vec![0f32; batch * rows]);
            g.matmul_with(isa, &x, &mut gx);
            u.matmul_with(isa, &x, &mut ux);
            let mut want = vec![0f32; batch * rows];
            crate::kernels::silu_mul(&gx, &ux, &mut want);
            let mut got = vec![f32::NAN; batch * rows];
            gated.matmul_with(isa, &x, &mut got);
            assert!(
                same_bits(&got, &want),
                "gated {name} {isa:?} {rows}x{cols} b{batch}"
            );
            if isa == Isa::best() {
                let fresh = gated.matmul_vec(&x);
                assert!(
                    same_bits(&fresh, &want),
                    "gated {name} b{batch}: matmul_vec"
                );
            }
        }
    }
}

#[test]
fn gated_pairs_apply_silu_gate_to_the_two_products() {
    every_interleaved!(check_gated);
}

#[test]
fn gated_pairs_need_matching_whole_groups() {
    let bytes = vec![0u8; 32 * 22];
    assert!(GatedPacked::<BlockQ5_0x8>::from_bytes(8, 32, &bytes[..176], &bytes[..176]).is_some());
    // Rows not a multiple of 8, none at all, gate and up of different sizes, a short count.
    assert!(GatedPacked::<BlockQ5_0x8>::from_bytes(12, 32, &bytes[..264], &bytes[..264]).is_none());
    assert!(GatedPacked::<BlockQ5_0x8>::from_bytes(0, 32, &[], &[]).is_none());
    assert!(GatedPacked::<BlockQ5_0x8>::from_bytes(8, 32, &bytes[..176], &bytes[..198]).is_none());
    assert!(GatedPacked::<BlockQ5_0x8>::from_bytes(8, 32, &bytes[..175], &bytes[..175]).is_none());
    // A byte too many in each, or a matrix without columns.
    assert!(GatedPacked::<BlockQ5_0x8>::from_bytes(16, 32, &bytes[..353], &bytes[..353]).is_none());
    assert!(GatedPacked::<BlockQ5_0x8>::from_bytes(8, 0, &[], &[]).is_none());
}

/// A gate/up pair of `rows × cols` matrices from a generator seeded with `seed`: the gate alone
/// repacked, the pair fused, and `batch` random activation rows.
fn gate_up_case<P: Interleaved>(
    rows: usize,
    cols: usize,
    batch: usize,
    seed: u64,
) -> (PackedMatrix<P>, GatedPacked<P>, Vec<f32>) {
    let len = <<P::Source as WeightBlock>::Act as ActFormat>::LEN;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let gate = random_blocks::<P::Source>(rows * cols / len, &mut rng);
    let up = random_blocks::<P::Source>(rows * cols / len, &mut rng);
    let x: Vec<f32> = (0..batch * cols)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let plain = PackedMatrix::<P>::from_bytes(rows, cols, &gate).unwrap();
    let gated = GatedPacked::<P>::from_bytes(rows, cols, &gate, &up).unwrap();
    (plain, gated, x)
}

/// AMX's product of every interleaved format is the AVX-512 VNNI tiles', bit for bit, plain and
/// gated: batches below and above the AMX threshold, one and several 16-row tiles, an odd
/// last group, several weight slices. Where the CPU has no AMX, or the OS does not grant it,
/// the kernels must not offer it.
fn check_amx<P: Interleaved>() {
    if !Isa::Amx.is_available() {
        assert!(!amx::available() || !Isa::Avx512Vnni.is_available());
        assert!(!Isa::available().contains(&Isa::Amx) && Isa::best() != Isa::Amx);
        eprintln!("no AMX here: only its absence is checked");
        return;
    }
    let name = <P::Source as WeightBlock>::NAME;
    let len = <<P::Source as WeightBlock>::Act as ActFormat>::LEN;
    for (rows, blocks, batch) in [
        (8, 1, 8),
        (24, 3, 9),
        (16, 28, 16),
        (40, 5, 17),
        (64, 2, 33),
        (512, 36, 12),
        (32, 4, 7),
        (16, 3, 4),
        (24, 2, 5),
        (24, 2, 6),
    ] {
        let cols = blocks * len;
        let seed = (rows * 5 + cols + batch) as u64;
        let (plain, gated, x) = gate_up_case::<P>(rows, cols, batch, seed);
        for kernel in [&plain as &dyn QuantKernel<Act = _>, &gated] {
            let mut want = vec![f32::NAN; batch * rows];
            kernel.matmul_with(Isa::Avx512Vnni, &x, &mut want);
            let mut got = vec![f32::NAN; batch * rows];
            kernel.matmul_with(Isa::Amx, &x, &mut got);
            assert!(
                same_bits(&got, &want),
                "AMX {name} {rows}x{cols} b{batch}: differs from AVX-512 VNNI"
            );
        }
    }
}

/// A row's product is the same bits with every SIMD instruction set and wherever it sits in a
/// batch, plain and gated: the integer sums are exact and the float steps the same operations
/// in the same order, in the 256-bit tiles (whose Q4_K tiles of four rows, in batches of 8
/// and 17, and Q6_K tiles of eight, in the batch of 8, take the assembly passes with AVX-512
/// VNNI), the 512-bit one-row kernels and the AMX tiles alike. So a sequence decodes the same alone or batched, and on any of these paths.
fn check_row_bits<P: Interleaved>() {
    if !Isa::Avx2.is_available() {
        eprintln!("no SIMD path here: nothing to compare");
        return;
    }
    if !Isa::Avx512Vnni.is_available() {
        eprintln!("no AVX-512 VNNI here: the 512-bit row kernels are not among the paths");
    }
    let name = <P::Source as WeightBlock>::NAME;
    let len = <<P::Source as WeightBlock>::Act as ActFormat>::LEN;
    // With AVX2, Q5_0's batches of 8 rows and more take the tall tiles (`interleaved::tall`),
    // the batch of 20 over several slices of weights.
    for (rows, blocks, batch) in [
        (8, 1, 9),
        (24, 3, 5),
        (16, 28, 6),
        (16, 28, 8),
        (40, 5, 17),
        (512, 14, 20),
    ] {
        let cols = blocks * len;
        let seed = (rows * 7 + cols + batch) as u64;
        let (plain, gated, x) = gate_up_case::<P>(rows, cols, batch, seed);
        for kernel in [&plain as &dyn QuantKernel<Act = _>, &gated] {
            let n = kernel.rows();
            let alone = |isa: Isa| -> Vec<f32> {
                let mut out = vec![f32::NAN; batch * n];
                for (x, out) in x.chunks_exact(cols).zip(out.chunks_exact_mut(n)) {
                    kernel.matmul_with(isa, x, out);
                }
                out
            };
            let want = alone(Isa::Avx2);
            for isa in Isa::available()
                .into_iter()
                .filter(|&isa| isa != Isa::Scalar)
            {
                let mut batched = vec![f32::NAN; batch * n];
                kernel.matmul_with(isa, &x, &mut batched);
                let shape = format!("{name} {rows}x{cols} b{batch} {isa:?}");
                assert!(
                    same_bits(&alone(isa), &want),
                    "{shape}: rows alone differ from AVX2's"
                );
                assert!(
                    same_bits(&batched, &want),
                    "{shape}: the batch differs from AVX2's rows"
                );
            }
        }
    }
}

#[test]
fn a_row_is_the_same_bits_alone_batched_and_on_every_simd_path() {
    every_interleaved!(check_row_bits);
}

/// The 512-bit one-row kernel, called directly on one interleaved group, gives the 256-bit
/// one-row tile's bits (so the check above cannot pass by the dispatch skipping it).
#[cfg(target_arch = "x86_64")]
fn check_row_zmm<P: Interleaved>() {
    if !Isa::Avx512Vnni.is_available() {
        eprintln!("no AVX-512 VNNI here: the 512-bit kernels run only on the emulated CPUs");
        return;
    }
    assert!(
        P::ROW_ZMM,
        "every interleaved format has a 512-bit row kernel"
    );
    let name = <P::Source as WeightBlock>::NAME;
    let len = <<P::Source as WeightBlock>::Act as ActFormat>::LEN;
    let size = std::mem::size_of::<P::Source>();
    for kb in [1, 3, 28] {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(kb as u64 * 97);
        let bytes =
            random_blocks::<P::Source>(crate::kernels::qmatmul::interleaved::ROWS * kb, &mut rng);
        // SAFETY: each source block is plain integer and f16 fields, any bits valid, read
        // unaligned from inside `bytes`.
        let source = |row: usize, b: usize| unsafe {
            std::ptr::read_unaligned(bytes[(row * kb + b) * size..].as_ptr() as *const P::Source)
        };
        let w: Vec<P> = (0..kb)
            .map(|b| {
                let rows: [P::Source; crate::kernels::qmatmul::interleaved::ROWS] =
                    std::array::from_fn(|i| source(i, b));
                P::pack(std::array::from_fn(|i| &rows[i]))
            })
            .collect();
        let x: Vec<f32> = (0..kb * len).map(|_| rng.random_range(-3.0..3.0)).collect();
        let mut acts = vec![<P::Source as WeightBlock>::Act::ZERO; kb];
        quantize_row(&x, &mut acts);
        let (mut zmm, mut ymm) = (
            [f32::NAN; crate::kernels::qmatmul::interleaved::ROWS],
            [[f32::NAN; crate::kernels::qmatmul::interleaved::ROWS]],
        );
        // SAFETY: AVX-512 VNNI is available; `w` and `acts` hold `kb` blocks.
        unsafe {
            P::row_zmm(&w, &acts, kb, &mut zmm);
            P::tile_simd(Isa::Avx512Vnni, &w, &acts, kb, &mut ymm);
        }
        assert!(
            same_bits(&zmm, &ymm[0]),
            "{name} {kb} blocks: {zmm:?} vs {ymm:?}"
        );
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_512_bit_row_kernels_give_the_256_bit_tiles_bits() {
    every_interleaved!(check_row_zmm);
}

/// The 512-bit pair tiles, called directly on two interleaved groups and 1 to 16 activation
/// rows, give each row the 256-bit one-row tile's bits for both groups (so the batch checks
/// above cannot pass by the dispatch skipping them).
#[cfg(target_arch = "x86_64")]
fn check_zmm_pair<P: Interleaved>() {
    use crate::kernels::qmatmul::interleaved::ROWS;
    if !Isa::Avx512Vnni.is_available() || !P::ZMM_PAIR {
        eprintln!("no 512-bit pair tiles here");
        return;
    }
    let name = <P::Source as WeightBlock>::NAME;
    let len = <<P::Source as WeightBlock>::Act as ActFormat>::LEN;
    let size = std::mem::size_of::<P::Source>();
    for (kb, rows) in [(1, 1), (3, 4), (2, 7), (9, 16), (1, 13)] {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((kb * 31 + rows) as u64);
        let bytes = random_blocks::<P::Source>(2 * ROWS * kb, &mut rng);
        // SAFETY: each source block is plain integer and f16 fields, any bits valid, read
        // unaligned from inside `bytes`.
        let source = |row: usize, b: usize| unsafe {
            std::ptr::read_unaligned(bytes[(row * kb + b) * size..].as_ptr() as *const P::Source)
        };
        let group = |g: usize| -> Vec<P> {
            (0..kb)
                .map(|b| {
                    let src: [P::Source; ROWS] = std::array::from_fn(|i| source(g * ROWS + i, b));
                    P::pack(std::array::from_fn(|i| &src[i]))
                })
                .collect()
        };
        let (w0, w1) = (group(0), group(1));
        let x: Vec<f32> = (0..rows * kb * len)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let mut acts = vec![<P::Source as WeightBlock>::Act::ZERO; rows * kb];
        for (row, a) in x.chunks_exact(kb * len).zip(acts.chunks_exact_mut(kb)) {
            quantize_row(row, a);
        }
        let mut pair = [[f32::NAN; 16]; 16];
        // SAFETY: AVX-512 VNNI is available; each group holds `kb` blocks, `acts` `rows · kb`.
        unsafe { P::zmm_pair([&w0, &w1], &acts, kb, rows, false, &mut pair) };
        for (r, got) in pair.iter().enumerate().take(rows) {
            let a = &acts[r * kb..(r + 1) * kb];
            for (g, w) in [&w0, &w1].into_iter().enumerate() {
                let mut want = [[f32::NAN; ROWS]];
                // SAFETY: as above, for one row.
                unsafe { P::tile_simd(Isa::Avx512Vnni, w, a, kb, &mut want) };
                assert!(
                    same_bits(&got[g * ROWS..(g + 1) * ROWS], &want[0]),
                    "{name} {kb} blocks, {rows} rows: row {r}, group {g}"
                );
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn the_512_bit_pair_tiles_give_the_256_bit_tiles_bits() {
    every_interleaved!(check_zmm_pair);
}

/// A tile configuration another library loaded in this thread (candle's quantized matmul
/// loads its own once a thread) is the one loaded after our AMX kernels ran, and so is none.
#[cfg(target_arch = "x86_64")]
#[test]
fn amx_kernels_give_back_the_tile_configuration_they_found() {
    if !Isa::Amx.is_available() {
        assert!(!Isa::available().contains(&Isa::Amx));
        eprintln!("no AMX here: nothing to check");
        return;
    }
    let (rows, cols, batch) = (48, 4 * 32, 16);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    let bytes = random_blocks::<BlockQ8_0>(rows * cols / 32, &mut rng);
    let m = PackedQ8_0::from_bytes(rows, cols, &bytes).unwrap();
    let x: Vec<f32> = (0..batch * cols).map(|i| (i % 7) as f32 - 3.0).collect();
    // Palette 1, tile 7 of 16 rows × 64 bytes: one our kernels do not configure.
    let mut foreign = [0u8; 64];
    foreign[0] = 1;
    foreign[16 + 2 * 7..16 + 2 * 7 + 2].copy_from_slice(&64u16.to_le_bytes());
    foreign[48 + 7] = 16;
    // One thread: the calling one does the whole product.
    let pool = crate::kernels::parallel::ComputePool::new(1, "amx-config");
    for loaded in [foreign, [0; 64]] {
        let mut out = vec![0f32; batch * rows];
        let after = crate::kernels::parallel::with_pool(&pool, || unsafe {
            amx::load_config(&loaded);
            m.matmul_with(Isa::Amx, &x, &mut out);
            amx::loaded_config()
        });
        assert_eq!(after, loaded, "the tile configuration after an AMX product");
    }
}

#[test]
fn amx_tiles_give_the_vnni_products() {
    every_interleaved!(check_amx);
}

#[test]
fn packed_q4_k_matches_the_dense_reference() {
    check_packed::<BlockQ4Kx8>();
}

#[test]
fn packed_q6_k_matches_the_dense_reference() {
    check_packed::<BlockQ6Kx8>();
}

#[test]
fn packed_q4_0_matches_the_dense_reference() {
    check_packed::<BlockQ4_0x8>();
}

#[test]
fn packed_q4_1_matches_the_dense_reference() {
    check_packed::<BlockQ4_1x8>();
}

#[test]
fn packed_q5_0_matches_the_dense_reference() {
    check_packed::<BlockQ5_0x8>();
}

#[test]
fn packed_q8_0_matches_the_dense_reference() {
    check_packed::<BlockQ8_0x8>();
}

#[test]
fn packed_matrices_need_whole_groups_of_eight_rows() {
    let bytes = vec![0u8; 12 * 210];
    assert!(PackedQ4K::from_bytes(12, 256, &bytes[..12 * 144]).is_none());
    assert!(PackedQ4K::from_bytes(8, 256, &bytes[..8 * 144]).is_some());
    assert!(PackedQ4K::from_bytes(8, 256, &bytes[..8 * 144 - 1]).is_none());
    assert!(PackedQ6K::from_bytes(12, 256, &bytes).is_none());
    assert!(PackedQ6K::from_bytes(8, 256, &bytes[..8 * 210]).is_some());
    assert!(PackedQ5_0::from_bytes(12, 32, &bytes[..12 * 22]).is_none());
    assert!(PackedQ5_0::from_bytes(8, 32, &bytes[..8 * 22]).is_some());
    assert!(PackedQ8_0::from_bytes(8, 48, &bytes[..12 * 34]).is_none());
}
