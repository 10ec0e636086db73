//! The one place a quantized matrix gets its kernel: the interleaved layout
//! ([`PackedMatrix`], or [`GatedPacked`] for a feed-forward's gate and up) for every format
//! that has one when the rows come in whole groups of eight, else the ggml block layout read in
//! place ([`QuantMatrix`]). Callers name the format with [`Format`], so nothing above the
//! kernels picks a block type.

use super::{
    BlockQ4K, BlockQ4Kx8, BlockQ4_0, BlockQ4_0x8, BlockQ4_1, BlockQ4_1x8, BlockQ5_0, BlockQ5_0x8,
    BlockQ6K, BlockQ6Kx8, BlockQ8_0, BlockQ8_0x8, GatedPacked, PackedMatrix, QuantKernel,
    QuantMatrix,
};

/// The kernel for a `[rows, cols]` matrix of `format` whose ggml bytes `owner` holds: a
/// repacked copy where the format has an interleaved layout and the shape fits it (`owner` is
/// then dropped), else the bytes read in place. `None` where the bytes do not hold such a
/// matrix.
pub fn kernel(
    format: Format,
    rows: usize,
    cols: usize,
    owner: impl AsRef<[u8]> + Send + Sync + 'static,
) -> Option<Box<dyn OwnKernel>> {
    packed(format, rows, cols, owner.as_ref()).or_else(|| in_place(format, rows, cols, owner))
}

/// A ggml block format our kernels multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q5_0,
    Q8_0,
    Q4K,
    Q6K,
}

/// One of our quantized kernels, whatever its block format and layout.
pub trait OwnKernel: Send + Sync {
    fn out_features(&self) -> usize;
    fn in_features(&self) -> usize;
    fn matmul(&self, x: &[f32], out: &mut [f32]);
    /// The product in a new vector (`out_features` values per row of `x`).
    fn matmul_vec(&self, x: &[f32]) -> Vec<f32>;
    /// Row `row` dequantized into `out` (`in_features` values), where the layout supports it.
    fn dequantize_row(&self, row: usize, out: &mut [f32]) -> bool;
    /// Has idle compute threads request the weights ahead of the next product.
    fn prefetch_ahead(&self);
}

impl<K: QuantKernel> OwnKernel for K {
    fn out_features(&self) -> usize {
        self.rows()
    }
    fn in_features(&self) -> usize {
        self.cols()
    }
    fn matmul(&self, x: &[f32], out: &mut [f32]) {
        QuantKernel::matmul(self, x, out)
    }
    fn matmul_vec(&self, x: &[f32]) -> Vec<f32> {
        QuantKernel::matmul_vec(self, x)
    }
    fn dequantize_row(&self, row: usize, out: &mut [f32]) -> bool {
        QuantKernel::dequantize_row(self, row, out)
    }
    fn prefetch_ahead(&self) {
        QuantKernel::prefetch_ahead(self)
    }
}

/// `$kernel::<P>::from_bytes($args)` for the interleaved format `P` of ggml type `$dtype`,
/// boxed; `None` for a type without one, or where `from_bytes` refuses the shape.
macro_rules! interleaved {
    ($dtype:expr, $kernel:ident, ($($arg:expr),*)) => {{
        fn boxed<K: QuantKernel + 'static>(k: K) -> Box<dyn OwnKernel> {
            Box::new(k)
        }
        match $dtype {
            Format::Q4_0 => $kernel::<BlockQ4_0x8>::from_bytes($($arg),*).map(boxed),
            Format::Q4_1 => $kernel::<BlockQ4_1x8>::from_bytes($($arg),*).map(boxed),
            Format::Q5_0 => $kernel::<BlockQ5_0x8>::from_bytes($($arg),*).map(boxed),
            Format::Q8_0 => $kernel::<BlockQ8_0x8>::from_bytes($($arg),*).map(boxed),
            Format::Q4K => $kernel::<BlockQ4Kx8>::from_bytes($($arg),*).map(boxed),
            Format::Q6K => $kernel::<BlockQ6Kx8>::from_bytes($($arg),*).map(boxed),
        }
    }};
}

/// Our kernel on a copy of `bytes` (a `[rows, cols]` matrix of `format`) repacked for it,
/// eight rows interleaved (an exact repack; see `interleaved`). `None` where the shape has no
/// whole groups of eight rows.
pub fn packed(
    format: Format,
    rows: usize,
    cols: usize,
    bytes: &[u8],
) -> Option<Box<dyn OwnKernel>> {
    interleaved!(format, PackedMatrix, (rows, cols, bytes))
}

/// The gate and up matrices of a feed-forward layer (`[rows, cols]` each, of `format`) as one
/// kernel whose product is `silu(x · gateᵀ) · (x · upᵀ)` (see [`GatedPacked`]); `None` unless
/// `rows` is a multiple of 8.
pub fn gated(
    format: Format,
    rows: usize,
    cols: usize,
    gate: &[u8],
    up: &[u8],
) -> Option<Box<dyn OwnKernel>> {
    interleaved!(format, GatedPacked, (rows, cols, gate, up))
}

/// Our kernel over `owner`'s bytes in the ggml block layout, read where they are (no copy);
/// `None` where the bytes do not hold a `[rows, cols]` matrix of `format`.
pub fn in_place(
    format: Format,
    rows: usize,
    cols: usize,
    owner: impl AsRef<[u8]> + Send + Sync + 'static,
) -> Option<Box<dyn OwnKernel>> {
    fn boxed<K: QuantKernel + 'static>(k: K) -> Box<dyn OwnKernel> {
        Box::new(k)
    }
    match format {
        Format::Q4_0 => QuantMatrix::<BlockQ4_0>::in_place(rows, cols, owner).map(boxed),
        Format::Q4_1 => QuantMatrix::<BlockQ4_1>::in_place(rows, cols, owner).map(boxed),
        Format::Q5_0 => QuantMatrix::<BlockQ5_0>::in_place(rows, cols, owner).map(boxed),
        Format::Q8_0 => QuantMatrix::<BlockQ8_0>::in_place(rows, cols, owner).map(boxed),
        Format::Q4K => QuantMatrix::<BlockQ4K>::in_place(rows, cols, owner).map(boxed),
        Format::Q6K => QuantMatrix::<BlockQ6K>::in_place(rows, cols, owner).map(boxed),
    }
}
