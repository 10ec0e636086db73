//! The instruction sets the quantized kernels have a path for, which of them this CPU has, and
//! the one in use (the fastest, or the one the program chose with [`Isa::select`]).

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
    /// (`interleaved::avx512_row`).
    Avx512Vnni,
    /// AVX-512 VNNI, with AMX's tile multiplies for the products of several activation rows
    /// in the formats that have an AMX path (see `qmatmul::amx`); only where the OS granted
    /// the tile registers.
    Amx,
}

/// An instruction-set name the kernels cannot use.
#[derive(Debug, thiserror::Error)]
pub enum IsaError {
    #[error("'{value}' is not one of scalar, avx2, avx-vnni, avx512-vnni, amx")]
    Unknown { value: String },
    #[error("'{value}': this CPU lacks it (it has {available})")]
    Unavailable { value: String, available: String },
    #[error("the kernels already run with {in_use}; choose the instruction set before they start")]
    AlreadyInUse { in_use: &'static str },
}

/// The instruction set the kernels use, decided once per process.
static IN_USE: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();

impl Isa {
    /// Every instruction set, slowest first.
    pub const ALL: [Isa; 5] = [
        Self::Scalar,
        Self::Avx2,
        Self::AvxVnni,
        Self::Avx512Vnni,
        Self::Amx,
    ];

    /// Its name, as [`Isa::parse`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avx-vnni",
            Self::Avx512Vnni => "avx512-vnni",
            Self::Amx => "amx",
        }
    }

    /// The one the kernels use: the one [`Isa::select`] chose, else the fastest this CPU
    /// supports (decided at the first call).
    pub fn best() -> Self {
        *IN_USE.get_or_init(Self::fastest)
    }

    /// The fastest this CPU supports.
    pub fn fastest() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|isa| isa.is_available())
            .unwrap_or(Self::Scalar)
    }

    /// The instruction set `name` names, if this CPU has it.
    pub fn parse(name: &str) -> Result<Self, IsaError> {
        let value = name.trim().to_string();
        let Some(isa) = Self::ALL.into_iter().find(|isa| isa.name() == value) else {
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
        Ok(isa)
    }

    /// Makes this the instruction set every kernel of the process uses, instead of the
    /// fastest: only before the first kernel runs, and only one this CPU has.
    pub fn select(self) -> Result<(), IsaError> {
        let isa = Self::parse(self.name())?;
        match *IN_USE.get_or_init(|| isa) {
            in_use if in_use == isa => Ok(()),
            in_use => Err(IsaError::AlreadyInUse {
                in_use: in_use.name(),
            }),
        }
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
