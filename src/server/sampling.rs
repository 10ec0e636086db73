//! The sampling fields every endpoint shares, as a request gives them, and their conversion
//! into the sampler's validated parameters.

use serde::Deserialize;
use utoipa::ToSchema;

use super::error::ApiError;
use crate::model::SamplingParams;

/// Sampling fields every endpoint shares; absent ones take the sampler's defaults. The ranges
/// stated are the ones `SamplingParams::validate` enforces.
/// Read as JSON numbers are (f64) and narrowed for the sampler by [`narrow`].
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingFields {
    /// 0: greedy. Default 1.
    #[schema(minimum = 0, maximum = 100)]
    pub temperature: Option<f64>,
    /// Nucleus sampling's probability mass. Default 1.
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    /// -1 or 0: no limit.
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f64>,
    /// Fixes the draws; without it they differ per request.
    pub seed: Option<u64>,
    #[schema(minimum = -2, maximum = 2)]
    pub presence_penalty: Option<f64>,
    #[schema(minimum = -2, maximum = 2)]
    pub frequency_penalty: Option<f64>,
    /// 1: off. Default 1.
    #[schema(exclusive_minimum = 0, maximum = 10)]
    pub repetition_penalty: Option<f64>,
}

/// A request's number as the sampler's f32, keeping its sign and whether it is zero: a
/// positive value too small for f32 becomes the smallest positive f32 rather than 0, so a
/// `top_p` of 1e-300 is the tiny mass it asks for, not an out-of-range 0.
fn narrow(value: f64) -> f32 {
    let narrowed = value as f32;
    if narrowed == 0.0 && value != 0.0 {
        f32::from_bits(1).copysign(value as f32)
    } else {
        narrowed
    }
}

impl SamplingFields {
    /// Sampling parameters, validated; `top_k` of 0 or -1 means no limit (vLLM's convention).
    pub fn params(&self) -> Result<SamplingParams, ApiError> {
        let d = SamplingParams::default();
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k: {k} must be -1, 0 or positive"),
                ))
            }
        };
        let or = |value: Option<f64>, default: f32| value.map_or(default, narrow);
        let params = SamplingParams {
            temperature: or(self.temperature, d.temperature),
            top_p: or(self.top_p, d.top_p),
            top_k,
            min_p: or(self.min_p, d.min_p),
            presence_penalty: or(self.presence_penalty, d.presence_penalty),
            frequency_penalty: or(self.frequency_penalty, d.frequency_penalty),
            repetition_penalty: or(self.repetition_penalty, d.repetition_penalty),
            seed: self.seed,
        };
        params.validate().map_err(|e| match e {
            crate::model::ModelError::InvalidSampling { field, .. } => {
                ApiError::invalid(field, e.to_string())
            }
            other => ApiError::invalid("body", other.to_string()),
        })?;
        Ok(params)
    }
}

#[cfg(test)]
mod tests {
    use super::super::schema::ChatRequest;
    use super::*;

    /// A positive value below f32's range stays positive; zero and signs are kept.
    #[test]
    fn narrowing_keeps_positive_values_positive() {
        assert!(narrow(5e-324) > 0.0);
        assert!(narrow(-5e-324) < 0.0);
        assert_eq!(narrow(0.0), 0.0);
        assert_eq!(narrow(0.5), 0.5);
        assert!(narrow(1e300).is_infinite());
        let top_p = br#"{"messages": [{"role": "user", "content": "q"}], "top_p": 5e-324}"#;
        let params = ChatRequest::parse(top_p)
            .unwrap()
            .to_request()
            .unwrap()
            .params;
        assert!(params.top_p > 0.0);
    }
}
