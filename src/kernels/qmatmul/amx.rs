//! Intel AMX (Advanced Matrix Extensions): eight 1 KB tile registers and a tile unit whose one
//! instruction (`tdpbsud`, `tdpbssd`) multiplies a tile of up to 16 rows × 64 bytes with one
//! of 16 rows × 64 bytes (four bytes of each of 16 columns a row) into 16 × 16 32-bit sums.
//!
//! * **Permission.** Linux leaves the tile registers off until a process asks for them
//!   (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`): a tile instruction without that dies
//!   with an illegal-instruction signal even where the CPU lists AMX. [`available`] asks once
//!   and says yes only if the CPU has AMX-TILE and AMX-INT8 and the kernel granted it; the
//!   kernels take the AMX path only after that (through [`Isa::Amx`](super::Isa::Amx)).
//! * **Registers.** Stable Rust has no AMX intrinsics, so the instructions are inline
//!   assembly. The compiler neither uses nor saves the tile registers; the kernels set them
//!   up ([`with_tiles`]) for each run of products and load back what they found after, since
//!   other AMX code in the process (candle's) may keep its own configuration loaded.
//! * **Shapes.** Two sets of three registers (0–2 and 3–5), so that one block's multiply can
//!   run while the other set's sums are stored: the 32-bit sums (`rows` × 16 columns), the
//!   activations (`rows` × 32 bytes, one 32-value block of each row; 16 for Q6_K's 16-value
//!   scales) and the weights (8 rows of four bytes × 16 columns, or 4: one block of 16 weight
//!   rows).

#[cfg(target_arch = "x86_64")]
use std::arch::asm;

/// Whether the AMX kernels can run here: the CPU has AMX-TILE and AMX-INT8 and the OS let
/// this process use the tile registers (asked once).
pub fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| cpu_has_amx() && os_permits())
}

/// CPUID leaf 7: EDX bit 24 (AMX-TILE) and bit 25 (AMX-INT8); leaf 0 must reach 7.
fn cpu_has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid_count;
        // Leaf 7 counts only where leaf 0 says it exists.
        let (max, edx) = (__cpuid_count(0, 0).eax, __cpuid_count(7, 0).edx);
        max >= 7 && edx & (1 << 24) != 0 && edx & (1 << 25) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Asks Linux for the tile data state (`XFEATURE_XTILEDATA`, 18) and checks that it is
/// granted; `false` on other systems.
fn os_permits() -> bool {
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    {
        const ARCH_GET_XCOMP_PERM: libc::c_long = 0x1022;
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XTILEDATA: libc::c_long = 18;
        let mut granted: u64 = 0;
        // SAFETY: both calls pass what the arch_prctl interface expects: a feature number,
        // and a pointer to a u64 the kernel writes the permitted features' bitmap into.
        unsafe {
            if libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA) != 0 {
                return false;
            }
            if libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_GET_XCOMP_PERM,
                &mut granted as *mut u64,
            ) != 0
            {
                return false;
            }
        }
        granted & (1 << XTILEDATA) != 0
    }
    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    false
}

/// Activation rows of one tile at most.
pub const TILE_ROWS: usize = 16;
/// Weight rows (output columns) of one tile.
pub const TILE_COLS: usize = 16;

/// The `ldtilecfg` operand (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile register.
    colsb: [u16; 16],
    /// Rows of each tile register.
    rows: [u8; 16],
}

impl TileConfig {
    /// No configuration (palette 0): what `sttilecfg` stores where none is loaded, and loads
    /// as none.
    const NONE: Self = Self {
        palette: 0,
        start_row: 0,
        reserved: [0; 14],
        colsb: [0; 16],
        rows: [0; 16],
    };
}

/// Runs `f` with this thread's tiles configured for `rows` activation rows (1 to
/// [`TILE_ROWS`]) and products `depth` bytes deep (4 to 64, a multiple of 4: the activation
/// tile's bytes a row, the weight tile's rows times 4), then loads back the configuration it
/// found (also if `f` panics). Other AMX code in the process may configure a thread's tiles
/// once and count on it (candle's quantized matmul does): leaving ours loaded made its next
/// tile load fault.
///
/// # Safety
/// [`available`] must have returned `true`.
#[cfg(target_arch = "x86_64")]
#[inline]
pub unsafe fn with_tiles<R>(rows: usize, depth: usize, f: impl FnOnce() -> R) -> R {
    assert!((1..=TILE_ROWS).contains(&rows), "{rows} rows in a tile");
    assert!(
        (4..=64).contains(&depth) && depth.is_multiple_of(4),
        "products {depth} bytes deep"
    );
    let mut found = TileConfig::NONE;
    // All zero where no configuration is loaded, which loads back as none.
    asm!("sttilecfg [{0}]", in(reg) &mut found, options(nostack));
    let mut config = TileConfig {
        palette: 1,
        ..TileConfig::NONE
    };
    // Each set: the sums, the activations, the weights.
    for set in [0, 3] {
        let shapes = [
            (set, 64, rows),
            (set + 1, depth, rows),
            (set + 2, 64, depth / 4),
        ];
        for (tile, colsb, height) in shapes {
            config.colsb[tile] = colsb as u16;
            config.rows[tile] = height as u8;
        }
    }
    /// Loads the configuration found back when dropped.
    struct Restore(TileConfig);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: the configuration `sttilecfg` stored in this thread, valid to load.
            unsafe { asm!("ldtilecfg [{0}]", in(reg) &self.0, options(nostack, readonly)) };
        }
    }
    let _restore = Restore(found);
    asm!("ldtilecfg [{0}]", in(reg) &config, options(nostack, readonly));
    f()
}

/// One block's product with register set `set % 2` (sets alternate so that one block's
/// multiply can run while the other's sums are stored): loads the activation tile (`rows`
/// rows of `depth` bytes, row `r` at `a + r · stride`) and the weight tile (its first
/// `depth / 4` rows of `b`), multiplies them (signed activations × unsigned weights, or signed
/// ones if `signed`) and stores the 32-bit sums, row `r` to `out[r]`.
///
/// # Safety
/// It runs inside [`with_tiles`] for `rows` rows and some `depth`; the activation rows lie in
/// readable memory, and `b` points to `depth / 4` rows.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn product(
    set: usize,
    a: *const i8,
    stride: usize,
    b: *const [u8; 64],
    signed: bool,
    out: &mut [[i32; TILE_COLS]; TILE_ROWS],
) {
    macro_rules! product {
        ($c:literal, $a:literal, $b:literal, $op:literal) => {
            asm!(
                concat!("tileloadd ", $a, ", [{a} + {stride} * 1]"),
                concat!("tileloadd ", $b, ", [{b} + {row} * 1]"),
                concat!("tilezero ", $c),
                concat!($op, " ", $c, ", ", $a, ", ", $b),
                concat!("tilestored [{out} + {row} * 1], ", $c),
                a = in(reg) a,
                stride = in(reg) stride,
                b = in(reg) b,
                row = in(reg) 64usize,
                out = in(reg) out.as_mut_ptr(),
                options(nostack, preserves_flags)
            )
        };
    }
    match (set % 2, signed) {
        (0, false) => product!("tmm0", "tmm1", "tmm2", "tdpbsud"),
        (0, true) => product!("tmm0", "tmm1", "tmm2", "tdpbssd"),
        (_, false) => product!("tmm3", "tmm4", "tmm5", "tdpbsud"),
        (_, true) => product!("tmm3", "tmm4", "tmm5", "tdpbssd"),
    }
}

/// This thread's loaded tile configuration, as `sttilecfg` stores it (all zero where none is).
///
/// # Safety
/// [`available`] must have returned `true`.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) unsafe fn loaded_config() -> [u8; 64] {
    let mut found = TileConfig::NONE;
    asm!("sttilecfg [{0}]", in(reg) &mut found, options(nostack));
    std::mem::transmute::<TileConfig, [u8; 64]>(found)
}

/// Loads `config` (64 bytes, as `ldtilecfg` takes them) into this thread's tiles.
///
/// # Safety
/// [`available`] must have returned `true` and `config` be valid.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) unsafe fn load_config(config: &[u8; 64]) {
    #[repr(C, align(64))]
    struct Bytes([u8; 64]);
    let bytes = Bytes(*config);
    asm!("ldtilecfg [{0}]", in(reg) &bytes, options(nostack, readonly));
}
