//! Every format against candle's dequantization (an independent implementation of the ggml
//! layouts) multiplied out in f64, through every instruction set this CPU has.

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;
use half::f16;
use rand::{Rng, SeedableRng};

use super::*;

/// The byte offsets of a format's f16 scale fields, and candle's name for it.
fn layout<B: WeightBlock>() -> (&'static [usize], GgmlDType) {
    match B::NAME {
        "Q4_0" => (&[0], GgmlDType::Q4_0),
        "Q4_1" => (&[0, 2], GgmlDType::Q4_1),
        "Q5_0" => (&[0], GgmlDType::Q5_0),
        "Q8_0" => (&[0], GgmlDType::Q8_0),
        "Q4_K" => (&[0, 2], GgmlDType::Q4K),
        "Q6_K" => (&[208], GgmlDType::Q6K),
        other => panic!("no test layout for {other}"),
    }
}

fn random_blocks<B: WeightBlock>(n: usize, rng: &mut impl Rng) -> Vec<u8> {
    let size = std::mem::size_of::<B>();
    let mut bytes: Vec<u8> = (0..n * size).map(|_| rng.random()).collect();
    // Scales as sane f16 values rather than random bit patterns (the K-quants' integer
    // sub-block scales stay random).
    let (fields, _) = layout::<B>();
    let scale = if B::Act::LEN > QK { 0.002 } else { 0.05 };
    for block in bytes.chunks_exact_mut(size) {
        for &f in fields {
            let v = f16::from_f32(rng.random_range(-scale..scale));
            block[f..f + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    bytes
}

/// Whether two results are the same floats bit for bit (and as many).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Runs `$check::<P>()` for every interleaved format `P`.
macro_rules! every_interleaved {
    ($check:ident) => {
        $check::<BlockQ4_0x8>();
        $check::<BlockQ4_1x8>();
        $check::<BlockQ5_0x8>();
        $check::<BlockQ8_0x8>();
        $check::<BlockQ4Kx8>();
        $check::<BlockQ6Kx8>();
    };
}

/// A `[rows, cols]` matrix of `B` blocks dequantized by candle, row-major.
fn dequantized<B: WeightBlock>(bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let (_, dtype) = layout::<B>();
    let storage = QStorage::from_data(std::borrow::Cow::Borrowed(bytes), &Device::Cpu, dtype)
        .expect("candle storage");
    QTensor::new(storage, (rows, cols))
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// `x_q · W_deqᵀ` in f64 with the weights dequantized by candle and the activations as
/// quantized (`d · q`); also the sum of absolute terms, for the tolerance. Q4_1's offset
/// multiplies the f16-rounded activation sum (ggml's q8_1), so that term is corrected here
/// from the offset read straight from the block bytes.
fn reference<B: WeightBlock>(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    acts: &[B::Act],
    batch: usize,
) -> (Vec<f64>, Vec<f64>) {
    let w = dequantized::<B>(bytes, rows, cols);
    let kb = cols / B::Act::LEN;
    let mut out = vec![0f64; batch * rows];
    let mut mag = vec![0f64; batch * rows];
    for r in 0..batch {
        for c in 0..rows {
            let (mut total, mut abs) = (0f64, 0f64);
            for (i, wv) in w[c * cols..(c + 1) * cols].iter().enumerate() {
                let x = acts[r * kb + i / B::Act::LEN].value(i % B::Act::LEN);
                let t = *wv as f64 * x as f64;
                total += t;
                abs += t.abs();
            }
            if B::NAME == "Q4_1" {
                let size = std::mem::size_of::<B>();
                for b in 0..kb {
                    let at = (c * kb + b) * size + 2;
                    let m = f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f64();
                    let ab = (&acts[r * kb + b] as &dyn std::any::Any)
                        .downcast_ref::<ActBlock>()
                        .expect("Q4_1 multiplies 32-value activation blocks");
                    let exact = ab.d as f64 * ab.qs.iter().map(|&q| q as f64).sum::<f64>();
                    total += m * (ab.s as f64 - exact);
                }
            }
            out[r * rows + c] = total;
            mag[r * rows + c] = abs;
        }
    }
    (out, mag)
}

fn check<B: WeightBlock>(rows: usize, cols: usize, batch: usize) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((rows * 31 + cols * 7 + batch) as u64);
    let bytes = random_blocks::<B>(rows * cols / B::Act::LEN, &mut rng);
    let m = QuantMatrix::<B>::from_bytes(rows, cols, &bytes).unwrap();
    let x: Vec<f32> = (0..batch * cols)
        .map(|_| rng.random_range(-3.0..3.0))
        .collect();
    let mut outs: Vec<(Isa, Vec<f32>)> = Isa::available()
        .into_iter()
        .map(|isa| {
            let mut out = vec![f32::NAN; batch * rows];
            m.matmul_with(isa, &x, &mut out);
            (isa, out)
        })
        .collect();
    // The vector the model's layers take: not zeroed first (NaN-filled in test builds).
    outs.push((Isa::best(), m.matmul_vec(&x)));

    let kb = cols / B::Act::LEN;
    let mut acts = vec![B::Act::ZERO; batch * kb];
    for (row, a) in x.chunks_exact(cols).zip(acts.chunks_exact_mut(kb)) {
        quantize_row(row, a);
    }
    let (want, mag) = reference::<B>(&bytes, rows, cols, &acts, batch);
    let mut scalar = vec![0f32; batch * rows];
    for c in 0..rows {
        let mut sums = vec![0f32; batch];
        dot_tile_scalar(&m.blocks()[c * kb..(c + 1) * kb], 1, &acts, kb, &mut sums);
        for r in 0..batch {
            scalar[r * rows + c] = sums[r];
        }
    }
    for i in 0..want.len() {
        let tol = 1e-5 * mag[i] + 1e-4;
        let w = want[i];
        for (isa, out) in &outs {
            let got = out[i] as f64;
            assert!(
                (got - w).abs() < tol,
                "{} {isa:?} {rows}x{cols} b{batch} [{i}]: {got} vs {w} (tolerance {tol})",
                B::NAME
            );
        }
        let s = scalar[i] as f64;
        assert!(
            (s - w).abs() < tol,
            "{} scalar tile [{i}]: {s} vs {w}",
            B::NAME
        );
    }
}

/// Awkward shapes: one row, row counts that leave column-tile tails, batches that pass
/// through every row-tile height (17, 14 and 11 leave tails of 1, 2 and 3 rows after tiles of
/// 8 and 4), and an empty batch.
fn check_shapes<B: WeightBlock>() {
    let k = B::Act::LEN;
    for (rows, blocks, batch) in [
        (1, 1, 1),
        (7, 2, 17),
        (33, 3, 4),
        (64, 8, 16),
        (9, 2, 14),
        (3, 1, 11),
        (5, 1, 0),
    ] {
        check::<B>(rows, blocks * k, batch);
    }
}

#[test]
fn q4_0_matches_the_dense_reference() {
    check_shapes::<BlockQ4_0>();
}

#[test]
fn q4_1_matches_the_dense_reference() {
    check_shapes::<BlockQ4_1>();
}

#[test]
fn q5_0_matches_the_dense_reference() {
    check_shapes::<BlockQ5_0>();
}

#[test]
fn q8_0_matches_the_dense_reference() {
    check_shapes::<BlockQ8_0>();
}

#[test]
fn q4_k_matches_the_dense_reference() {
    check_shapes::<BlockQ4K>();
}

#[test]
fn q6_k_matches_the_dense_reference() {
    check_shapes::<BlockQ6K>();
}

#[test]
fn wrong_byte_counts_are_rejected() {
    assert!(QuantMatrix::<BlockQ4_0>::from_bytes(2, 32, &[0; 35]).is_none());
    assert!(QuantMatrix::<BlockQ4_0>::from_bytes(2, 48, &[0; 54]).is_none());
    // K-quants need whole 256-value super-blocks per row.
    assert!(QuantMatrix::<BlockQ4K>::from_bytes(1, 128, &[0; 72]).is_none());
    assert!(QuantMatrix::<BlockQ6K>::from_bytes(1, 256, &[0; 210]).is_some());
}

#[test]
fn activation_quantization_round_trips_within_half_a_step() {
    let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 5.0).collect();
    let mut a = vec![ActBlock::ZERO; 2];
    quantize_row(&x, &mut a);
    for (b, xs) in a.iter().zip(x.chunks_exact(QK)) {
        for (q, v) in b.qs.iter().zip(xs) {
            assert!((*q as f32 * b.d - v).abs() <= b.d * 0.51 + 1e-3);
        }
    }
}

#[test]
fn k_activation_blocks_keep_their_16_value_sums() {
    let x: Vec<f32> = (0..QK_K).map(|i| (i as f32 * 0.11).cos() * 2.0).collect();
    let mut a = ActBlockK::ZERO;
    ActBlockK::quantize(&x, &mut a);
    for (i, v) in x.iter().enumerate() {
        assert!((a.value(i) - v).abs() <= 2.0 / 127.0 * 0.51);
    }
    for (k, qs) in a.qs.chunks_exact(16).enumerate() {
        assert_eq!(
            a.bsums[k],
            qs.iter().map(|&q| q as i16).sum::<i16>(),
            "sums {k}"
        );
    }
    for (j, qs) in a.qs.chunks_exact(32).enumerate() {
        assert_eq!(a.bsums32[j], qs.iter().map(|&q| q as i16).sum::<i16>());
    }
}

#[test]
fn the_best_instruction_set_is_one_this_cpu_has() {
    let available = Isa::available();
    assert!(available.contains(&Isa::Scalar));
    assert!(available.contains(&Isa::best()));
    eprintln!("instruction sets here: {available:?}");
}

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
        (24, 2, 6),
    ] {
        let cols = blocks * len;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((rows * 5 + cols + batch) as u64);
        let gate = random_blocks::<P::Source>(rows * blocks, &mut rng);
        let up = random_blocks::<P::Source>(rows * blocks, &mut rng);
        let x: Vec<f32> = (0..batch * cols)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let plain = PackedMatrix::<P>::from_bytes(rows, cols, &gate).unwrap();
        let gated = GatedPacked::<P>::from_bytes(rows, cols, &gate, &up).unwrap();
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
/// in the same order, in the 256-bit tiles, the 512-bit one-row kernels and the AMX tiles
/// alike. So a sequence decodes the same alone or batched, and on any of these paths.
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
    for (rows, blocks, batch) in [(8, 1, 9), (24, 3, 5), (16, 28, 6), (40, 5, 17)] {
        let cols = blocks * len;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64((rows * 7 + cols + batch) as u64);
        let gate = random_blocks::<P::Source>(rows * blocks, &mut rng);
        let up = random_blocks::<P::Source>(rows * blocks, &mut rng);
        let x: Vec<f32> = (0..batch * cols)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        let plain = PackedMatrix::<P>::from_bytes(rows, cols, &gate).unwrap();
        let gated = GatedPacked::<P>::from_bytes(rows, cols, &gate, &up).unwrap();
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
        let bytes = random_blocks::<P::Source>(x8::ROWS * kb, &mut rng);
        // SAFETY: each source block is plain integer and f16 fields, any bits valid, read
        // unaligned from inside `bytes`.
        let source = |row: usize, b: usize| unsafe {
            std::ptr::read_unaligned(bytes[(row * kb + b) * size..].as_ptr() as *const P::Source)
        };
        let w: Vec<P> = (0..kb)
            .map(|b| {
                let rows: [P::Source; x8::ROWS] = std::array::from_fn(|i| source(i, b));
                P::pack(std::array::from_fn(|i| &rows[i]))
            })
            .collect();
        let x: Vec<f32> = (0..kb * len).map(|_| rng.random_range(-3.0..3.0)).collect();
        let mut acts = vec![<P::Source as WeightBlock>::Act::ZERO; kb];
        quantize_row(&x, &mut acts);
        let (mut zmm, mut ymm) = ([f32::NAN; x8::ROWS], [[f32::NAN; x8::ROWS]]);
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

/// The SIMD activation quantizer gives the scalar one's bytes and scale, halves and the
/// saturating top included.
#[test]
fn activation_rounding_matches_the_scalar_loop() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for case in 0..200 {
        let mut xs: Vec<f32> = (0..64).map(|_| rng.random_range(-4.0..4.0)).collect();
        if case % 3 == 0 {
            // Exact halves after scaling: amax 127 makes the scale 1.
            xs[0] = 127.0;
            for (i, x) in xs.iter_mut().enumerate().skip(1) {
                *x = (i as f32 - 32.0) + 0.5;
            }
        }
        if case == 1 {
            xs.fill(0.0);
        }
        let (mut fast, mut slow) = (vec![0i8; 64], vec![0i8; 64]);
        let d_fast = quantize_i8(&xs, &mut fast);
        let d_slow = quantize_i8_scalar(&xs, &mut slow);
        assert_eq!(d_fast.to_bits(), d_slow.to_bits(), "case {case}");
        assert_eq!(fast, slow, "case {case}");
    }
}

/// A row quantized at once (the SIMD path where the CPU has one) gives every block exactly as
/// the scalar loop and `half`'s f16 rounding do: values, scale, offset term and sum.
#[test]
fn row_quantization_matches_the_scalar_blocks() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    for case in 0..50 {
        let blocks = 1 + case % 7;
        // Every third case all positive: sums above 2048, where f16 rounds integers.
        let shift = if case % 3 == 2 { 6.0 } else { 0.0 };
        let mut x: Vec<f32> = (0..blocks * QK)
            .map(|_| (rng.random_range(-3.0..3.0) + shift) * (1 + case % 4) as f32)
            .collect();
        // An all-zero block, and one of exact halves after scaling.
        x[..QK].fill(0.0);
        if blocks > 1 {
            x[QK] = 127.0;
            for (i, v) in x[QK + 1..2 * QK].iter_mut().enumerate() {
                *v = i as f32 - 15.5;
            }
        }
        let mut fast = vec![ActBlock::ZERO; blocks];
        quantize_row(&x, &mut fast);
        for (b, (got, xs)) in fast.iter().zip(x.chunks_exact(QK)).enumerate() {
            let mut qs = [0i8; QK];
            let d = half::f16::from_f32(quantize_i8_scalar(xs, &mut qs));
            let sum: i32 = qs.iter().map(|&q| q as i32).sum();
            let s = (half::f16::from_f32(sum as f32) * d).to_f32();
            assert_eq!(got.qs, qs, "case {case} block {b}");
            assert_eq!(
                got.d.to_bits(),
                d.to_f32().to_bits(),
                "case {case} block {b}"
            );
            assert_eq!(got.s.to_bits(), s.to_bits(), "case {case} block {b}");
            assert_eq!(got.sum, sum, "case {case} block {b}");
        }
    }
}
