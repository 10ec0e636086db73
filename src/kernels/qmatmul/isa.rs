//! The instruction sets the quantized kernels have a path for, which of them this CPU has, and
//! the one in use (the fastest, or `TOKENROUTER_ISA`'s choice).

/// The instruction sets the kernels have a path for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust, the reference.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// The AVX2 kernels with AVX-VNNI's integer dot products (`vpdpbusd`, VEX-encoded):
    /// client cores without AVX-512 (Alder Lake and later).
    AvxVnni,
    /// The AVX2 kernels with AVX-512 VNNI's 256-bit integer dot products (`vpdpbusd`), and
    /// 512-bit kernels for one activation row in the interleaved formats that have them
    /// (`x8::zmm`).
    Avx512Vnni,
    /// AVX-512 VNNI, with AMX's tile multiplies for the products of several activation rows
    /// in the formats that have an AMX path (see `qmatmul::amx`); only where the OS granted
    /// the tile registers.
    Amx,
}

/// Environment variable that chooses the instruction set instead of the fastest one.
pub const ISA_ENV: &str = "TOKENROUTER_ISA";

/// A `TOKENROUTER_ISA` value the kernels cannot use.
#[derive(Debug, thiserror::Error)]
pub enum IsaError {
    #[error("{ISA_ENV}={value:?} is not one of scalar, avx2, avx-vnni, avx512-vnni, amx")]
    Unknown { value: String },
    #[error("{ISA_ENV}={value:?}: this CPU lacks it (it has {available})")]
    Unavailable { value: String, available: String },
}

impl Isa {
    /// Every instruction set, slowest first.
    pub const ALL: [Isa; 5] = [
        Self::Scalar,
        Self::Avx2,
        Self::AvxVnni,
        Self::Avx512Vnni,
        Self::Amx,
    ];

    /// The name `TOKENROUTER_ISA` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avx-vnni",
            Self::Avx512Vnni => "avx512-vnni",
            Self::Amx => "amx",
        }
    }

    /// The one the kernels use: `TOKENROUTER_ISA`'s choice when set and valid (else a
    /// warning), or the fastest this CPU supports (decided once).
    pub fn best() -> Self {
        static BEST: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| {
            let fastest = Self::ALL
                .into_iter()
                .rev()
                .find(|isa| isa.is_available())
                .unwrap_or(Self::Scalar);
            match Self::from_env() {
                Ok(chosen) => chosen.unwrap_or(fastest),
                Err(e) => {
                    tracing::warn!("{e}; using {}", fastest.name());
                    fastest
                }
            }
        })
    }

    /// The instruction set `TOKENROUTER_ISA` names, if it is set; an error names a value that
    /// is unknown or that this CPU lacks.
    pub fn from_env() -> Result<Option<Self>, IsaError> {
        let Ok(value) = std::env::var(ISA_ENV) else {
            return Ok(None);
        };
        let Some(isa) = Self::ALL.into_iter().find(|isa| isa.name() == value.trim()) else {
            return Err(IsaError::Unknown { value });
        };
        if !isa.is_available() {
            let here = Self::available()
                .into_iter()
                .map(Self::name)
                .collect::<Vec<_>>();
            return Err(IsaError::Unavailable {
                value,
                available: here.join(", "),
            });
        }
        Ok(Some(isa))
    }

    /// Every one this CPU supports.
    pub fn available() -> Vec<Self> {
        Self::ALL
            .into_iter()
            .filter(|isa| isa.is_available())
            .collect()
    }

    pub fn is_available(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512vnni = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            match self {
                Self::Scalar => true,
                Self::Avx2 => avx2,
                Self::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Self::Avx512Vnni => avx512vnni,
                Self::Amx => avx512vnni && super::amx::available(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Self::Scalar
        }
    }
}
