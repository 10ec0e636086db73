//! Where a model computes: `device = "cpu"` (every core of the process), `"cpu:0-7"` (a set of
//! cores, with the compute threads pinned to it), or `"cuda:N"`. Models that name the same
//! device share its compute and take turns through its executor; devices with disjoint core
//! sets run side by side. Parsing and overlap checks only: no threads are started here.

use std::fmt;
use std::str::FromStr;

use serde::Deserialize;

/// A model's placement, as written in `config.toml`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "String")]
pub enum DeviceSpec {
    /// Every core the process may run on.
    #[default]
    Cpu,
    /// These cores (sorted, no repeats), with the compute threads pinned to them.
    CpuCores(Vec<usize>),
    /// A CUDA GPU by ordinal.
    Cuda(usize),
}

impl DeviceSpec {
    /// Whether two distinct devices would compute on a common core.
    pub fn overlaps(&self, other: &DeviceSpec) -> bool {
        match (self, other) {
            (Self::Cpu, Self::Cpu | Self::CpuCores(_)) | (Self::CpuCores(_), Self::Cpu) => true,
            (Self::CpuCores(a), Self::CpuCores(b)) => a.iter().any(|c| b.contains(c)),
            (Self::Cuda(a), Self::Cuda(b)) => a == b,
            _ => false,
        }
    }

    pub fn is_cpu(&self) -> bool {
        !matches!(self, Self::Cuda(_))
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::CpuCores(cores) => {
                write!(f, "cpu:")?;
                let mut first = true;
                let mut i = 0;
                while i < cores.len() {
                    let mut j = i;
                    while j + 1 < cores.len() && cores[j + 1] == cores[j] + 1 {
                        j += 1;
                    }
                    if !first {
                        write!(f, ",")?;
                    }
                    first = false;
                    if i == j {
                        write!(f, "{}", cores[i])?;
                    } else {
                        write!(f, "{}-{}", cores[i], cores[j])?;
                    }
                    i = j + 1;
                }
                Ok(())
            }
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!("device \"{s}\": {why} (expected \"cpu\", \"cpu:0-7\", \"cpu:0,2,4-5\" or \"cuda:0\")")
        };
        if s == "cpu" {
            return Ok(Self::Cpu);
        }
        if let Some(n) = s.strip_prefix("cuda:") {
            return n
                .parse()
                .map(Self::Cuda)
                .map_err(|_| bad("the GPU ordinal is not a number"));
        }
        let Some(list) = s.strip_prefix("cpu:") else {
            return Err(bad("unknown device"));
        };
        let mut cores = Vec::new();
        for part in list.split(',') {
            let num = |t: &str| {
                t.trim()
                    .parse::<usize>()
                    .map_err(|_| bad(&format!("'{t}' is not a core number")))
            };
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                None => (num(part)?, num(part)?),
            };
            if lo > hi {
                return Err(bad(&format!("the range {lo}-{hi} is empty")));
            }
            cores.extend(lo..=hi);
        }
        cores.sort_unstable();
        cores.dedup();
        Ok(Self::CpuCores(cores))
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceSpec;

    #[test]
    fn core_lists_parse_sorted_and_print_back_as_ranges() {
        let d: DeviceSpec = "cpu:4-5,0,2-3".parse().unwrap();
        assert_eq!(d, DeviceSpec::CpuCores(vec![0, 2, 3, 4, 5]));
        assert_eq!(d.to_string(), "cpu:0,2-5");
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda:1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda(1));
    }

    #[test]
    fn bad_devices_are_named() {
        for bad in ["gpu", "cpu:", "cpu:3-1", "cpu:a", "cuda:x"] {
            let err = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(err.contains(&format!("\"{bad}\"")), "{err}");
        }
    }

    #[test]
    fn devices_overlap_when_they_share_a_core() {
        let p = |s: &str| s.parse::<DeviceSpec>().unwrap();
        assert!(p("cpu").overlaps(&p("cpu:1")));
        assert!(p("cpu:0-3").overlaps(&p("cpu:3-4")));
        assert!(!p("cpu:0-3").overlaps(&p("cpu:4-7")));
        assert!(!p("cpu").overlaps(&p("cuda:0")));
    }
}
