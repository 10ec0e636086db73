//! Where a measured pass's time went (`bench-model --breakdown`): each part's share of the
//! time, and the matmuls' rates: the weight bytes a second of the decode steps (bound by
//! memory), the multiply-adds a second of the prefill (bound by compute), the latter against
//! the peak of the kernels' inner product on this CPU.

use serde_json::{json, Map, Value};

use tokenrouter::model::timing::{Breakdown, PROJECTIONS};
use tokenrouter::model::ModelConfig;

use tokenrouter::model::profile::Throughput;

use super::{ComputeScale, StepBytes};

/// [`PROJECTIONS`] as the table names them, and as the JSON lines' keys.
const PROJECTION_NAMES: [&str; PROJECTIONS.len()] = ["q/k/v", "o", "gate/up", "down"];
const PROJECTION_KEYS: [&str; PROJECTIONS.len()] = ["qkv", "attn_out", "gate_up", "down"];

/// A [`Breakdown`]'s parts as shares of a pass's time.
struct PartShares {
    matmul: f64,
    lm_head: f64,
    attention: f64,
    add_norm: f64,
    rotary_kv_write: f64,
    activation: f64,
    /// Everything else: the embedding lookup, the rotary angles, `argmax` over the logits,
    /// the next matmul's prefetch hints, the gaps between parts.
    other: f64,
}

impl PartShares {
    fn new(parts: &Breakdown, total: f64) -> Self {
        let timed = parts.matmul
            + parts.attention
            + parts.add_norm
            + parts.rotary_kv_write
            + parts.activation;
        Self {
            matmul: parts.matmul / total,
            lm_head: parts.lm_head / total,
            attention: parts.attention / total,
            add_norm: parts.add_norm / total,
            rotary_kv_write: parts.rotary_kv_write / total,
            activation: parts.activation / total,
            other: (total - timed).max(0.0) / total,
        }
    }

    fn describe(&self) -> String {
        format!(
            "matmuls {:.1} % (LM head {:.1} %), attention {:.1} %, adds and norms {:.1} %, rotary and K/V write {:.1} %, SiLU {:.1} %, other {:.1} %",
            100.0 * self.matmul,
            100.0 * self.lm_head,
            100.0 * self.attention,
            100.0 * self.add_norm,
            100.0 * self.rotary_kv_write,
            100.0 * self.activation,
            100.0 * self.other,
        )
    }

    fn json(&self) -> Map<String, Value> {
        let Value::Object(map) = json!({
            "matmul": self.matmul,
            "lm_head": self.lm_head,
            "attention": self.attention,
            "add_norm": self.add_norm,
            "rotary_kv_write": self.rotary_kv_write,
            "activation": self.activation,
            "other": self.other,
        }) else {
            unreachable!("an object literal")
        };
        map
    }
}

/// Each projection's share and rate, as JSON keyed by [`PROJECTION_KEYS`].
fn projections_json(projections: &[(f64, f64)], rate_key: &str) -> Value {
    PROJECTION_KEYS
        .iter()
        .zip(projections)
        .map(|(key, (share, rate))| (key.to_string(), json!({"share": share, rate_key: rate})))
        .collect::<Map<_, _>>()
        .into()
}

/// Each projection's share and rate, as the table's line lists them.
fn projections_line(projections: &[(f64, f64)], rate: impl Fn(f64) -> String) -> String {
    PROJECTION_NAMES
        .iter()
        .zip(projections)
        .map(|(name, (share, r))| format!("{name} {:.1} % at {}", 100.0 * share, rate(*r)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where the decode steps' time went, and the matmuls' weight rate.
pub(super) struct DecodeShares {
    parts: PartShares,
    /// GB/s of weights through all the matmuls, the layers' alone and the LM head's alone.
    matmul_gb_s: f64,
    layer_matmul_gb_s: f64,
    lm_head_gb_s: f64,
    /// Each of the layers' projections ([`PROJECTIONS`]): its share of the time and the GB/s
    /// of weights through it.
    projections: [(f64, f64); PROJECTIONS.len()],
}

impl DecodeShares {
    /// `bytes`: what every step's matmuls read.
    pub(super) fn new(parts: &Breakdown, step_secs: &[f64], bytes: &StepBytes) -> Self {
        let total: f64 = step_secs.iter().sum();
        let steps = step_secs.len() as f64;
        let gb_s = |per_step: f64, secs: f64| per_step * steps / secs / 1e9;
        Self {
            parts: PartShares::new(parts, total),
            matmul_gb_s: gb_s(bytes.weights, parts.matmul),
            layer_matmul_gb_s: gb_s(bytes.weights - bytes.lm_head, parts.matmul - parts.lm_head),
            lm_head_gb_s: gb_s(bytes.lm_head, parts.lm_head),
            projections: std::array::from_fn(|p| {
                let secs = parts.projections[p];
                (secs / total, gb_s(bytes.projections[p], secs))
            }),
        }
    }

    pub(super) fn print(&self) {
        println!(
            "{:>6} decode step: {}; the matmuls stream weights at {:.2} GB/s (the layers' {:.2}, the LM head's {:.2})",
            "",
            self.parts.describe(),
            self.matmul_gb_s,
            self.layer_matmul_gb_s,
            self.lm_head_gb_s,
        );
        let each = projections_line(&self.projections, |gb_s| format!("{gb_s:.2} GB/s"));
        println!("{:>6} the layers' matmuls: {each}", "");
    }

    pub(super) fn json(&self) -> Value {
        let mut obj = self.parts.json();
        obj.insert("matmul_gb_s".into(), self.matmul_gb_s.into());
        obj.insert("layer_matmul_gb_s".into(), self.layer_matmul_gb_s.into());
        obj.insert("lm_head_gb_s".into(), self.lm_head_gb_s.into());
        obj.insert(
            "projections".into(),
            projections_json(&self.projections, "gb_s"),
        );
        obj.into()
    }
}

/// Multiply-adds one token costs each of the layers' projections ([`PROJECTIONS`]), over
/// every layer.
pub(super) fn projection_macs(config: &ModelConfig) -> [f64; PROJECTIONS.len()] {
    let (hidden, inter) = (config.hidden_size as f64, config.intermediate_size as f64);
    let (q, kv) = (config.q_dim() as f64, config.kv_dim() as f64);
    let layers = config.num_layers as f64;
    [
        hidden * (q + 2.0 * kv),
        q * hidden,
        2.0 * hidden * inter,
        inter * hidden,
    ]
    .map(|macs| macs * layers)
}

/// Where the prefill's time went, and the layers' matmuls' multiply-adds a second.
pub(super) struct PrefillShares {
    parts: PartShares,
    /// Multiply-adds a second through the layers' matmuls (the LM head's last rows left out).
    layer_macs_per_s: f64,
    /// Each of the layers' projections: its share of the time and its multiply-adds a second.
    projections: [(f64, f64); PROJECTIONS.len()],
    /// The kernels' inner product's peak on this CPU, multiply-adds a second.
    peak: Option<f64>,
}

impl PrefillShares {
    /// `parts`: where the prefill of `throughput` went; `scale`: each projection's
    /// multiply-adds a token and the inner product's peak.
    pub(super) fn new(parts: &Breakdown, throughput: &Throughput, scale: &ComputeScale) -> Self {
        let (secs, macs) = (throughput.prefill_secs(), &scale.macs);
        let tokens = throughput.batch_tokens as f64;
        let rate = |macs: f64, secs: f64| macs * tokens / secs;
        Self {
            parts: PartShares::new(parts, secs),
            layer_macs_per_s: rate(macs.iter().sum(), parts.matmul - parts.lm_head),
            projections: std::array::from_fn(|p| {
                let secs_p = parts.projections[p];
                (secs_p / secs, rate(macs[p], secs_p))
            }),
            peak: scale.peak,
        }
    }

    pub(super) fn print(&self) {
        let of_peak = |rate: f64| match self.peak {
            Some(peak) => format!(
                "{:.1} G/s ({:.0} % of peak)",
                rate / 1e9,
                100.0 * rate / peak
            ),
            None => format!("{:.1} G/s", rate / 1e9),
        };
        println!(
            "{:>6} prefill: {}; the layers' matmuls do {} multiply-adds",
            "",
            self.parts.describe(),
            of_peak(self.layer_macs_per_s),
        );
        let each = projections_line(&self.projections, of_peak);
        println!("{:>6} the layers' matmuls: {each}", "");
    }

    pub(super) fn json(&self) -> Value {
        let mut obj = self.parts.json();
        obj.insert("layer_macs_per_s".into(), self.layer_macs_per_s.into());
        obj.insert("peak_macs_per_s".into(), self.peak.into());
        obj.insert(
            "projections".into(),
            projections_json(&self.projections, "macs_per_s"),
        );
        obj.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_qwen2_5_1_5b_token_costs_its_projections_multiply_adds() {
        let config = tokenrouter::model::random::shape("qwen2.5-1.5b").expect("a known shape");
        let macs = projection_macs(&config);
        // Written out: q 1536², k and v 256 × 1536 each, o 1536², gate, up and down
        // 8960 × 1536 each, 28 layers; 1.31 G in all.
        assert_eq!(macs[0], 28.0 * (1536.0 * 1536.0 + 2.0 * 256.0 * 1536.0));
        assert_eq!(macs[1], 28.0 * 1536.0 * 1536.0);
        assert_eq!(macs[2], 28.0 * 2.0 * 8960.0 * 1536.0);
        assert_eq!(macs[3], 28.0 * 8960.0 * 1536.0);
        let total: f64 = macs.iter().sum();
        assert!((total / 1e9 - 1.31).abs() < 0.01, "{total}");
    }
}
