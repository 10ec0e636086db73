//! Every format against candle's dequantization (an independent implementation of the ggml
//! layouts) multiplied out in f64, through every instruction set this CPU has: the ggml-layout
//! kernels and the activation quantizers here, the interleaved ones in `interleaved`.

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

mod interleaved;

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
