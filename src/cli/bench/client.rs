//! One streamed chat request, timed: time to first token, the gaps between content chunks,
//! end-to-end time, token counts from the usage chunk and the routing outcome.

use std::time::Instant;

use futures_util::StreamExt;
use serde_json::Value;

#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub ttft: f64,
    pub e2e: f64,
    /// Seconds between consecutive content chunks.
    pub gaps: Vec<f64>,
    /// Output tokens produced by the LLM (share reported by the server × tokens).
    pub llm_tokens: f64,
    /// Speculative decoding: drafted tokens verified, accepted, and the verifications.
    pub drafted: u64,
    pub accepted: u64,
    pub verifications: u64,
    pub text: String,
}

pub async fn chat(client: &awc::Client, url: &str, body: &Value) -> Result<Sample, String> {
    let started = Instant::now();
    let mut response = client
        .post(format!("{url}/v1/chat/completions"))
        .send_json(body)
        .await
        .map_err(|e| format!("sending: {e}"))?;
    if !response.status().is_success() {
        let status = response.status();
        let text = response
            .body()
            .await
            .map(|b| String::from_utf8_lossy(&b).to_string());
        return Err(format!("HTTP {status}: {}", text.unwrap_or_default()));
    }
    let mut sample = Sample::default();
    let mut buffer: Vec<u8> = Vec::new();
    let mut last_chunk: Option<Instant> = None;
    while let Some(bytes) = response.next().await {
        buffer.extend_from_slice(&bytes.map_err(|e| format!("reading the stream: {e}"))?);
        while let Some(end) = buffer.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buffer.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            let Some(data) = text.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                sample.e2e = started.elapsed().as_secs_f64();
                return Ok(sample);
            }
            let chunk: Value =
                serde_json::from_str(data).map_err(|e| format!("bad chunk {data}: {e}"))?;
            if let Some(error) = chunk.get("error") {
                return Err(format!("stream error: {error}"));
            }
            absorb(&mut sample, &chunk, started, &mut last_chunk);
        }
    }
    Err("the stream ended without [DONE]".into())
}

fn absorb(sample: &mut Sample, chunk: &Value, started: Instant, last: &mut Option<Instant>) {
    if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
        sample.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0) as usize;
        sample.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0) as usize;
    }
    let choice = &chunk["choices"][0];
    if let Some(content) = choice["delta"]["content"]
        .as_str()
        .filter(|c| !c.is_empty())
    {
        let now = Instant::now();
        match *last {
            None => sample.ttft = (now - started).as_secs_f64(),
            Some(prev) => sample.gaps.push((now - prev).as_secs_f64()),
        }
        *last = Some(now);
        sample.text.push_str(content);
    }
    if !choice["finish_reason"].is_null() {
        let share = chunk["routing"]["llm_token_share"].as_f64().unwrap_or(0.0);
        let total: u64 = chunk["routing"]["tokens_per_model"]
            .as_object()
            .map(|m| m.values().filter_map(Value::as_u64).sum())
            .unwrap_or(0);
        sample.llm_tokens = share * total as f64;
        let spec = &chunk["routing"]["speculative"];
        let count = |field: &str| spec[field].as_u64().unwrap_or(0);
        sample.drafted = count("drafted_tokens");
        sample.accepted = count("accepted_tokens");
        sample.verifications = count("verifications");
    }
}
