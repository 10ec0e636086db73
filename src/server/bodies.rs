//! Response bodies as types: what the handlers send, and what `GET /openapi.json` describes
//! (the document is derived from these same types, so it cannot drift from the answers).

use std::collections::BTreeMap;

use serde::Serialize;
use utoipa::ToSchema;

/// Why a choice ended: a stop condition (EOS or a stop string), or its token limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Finish {
    Stop,
    Length,
}

/// The routing outcome, over every choice of a response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Routing {
    /// Output tokens each model generated, by model name.
    pub tokens_per_model: BTreeMap<String, usize>,
    /// The LLM's share of the output tokens (absent without a model in the LLM role).
    pub llm_token_share: Option<f64>,
    /// Times generation moved from one model to another.
    pub handoffs: usize,
    /// Speculative decoding's drafts and their acceptance, when it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeStats>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SpeculativeStats {
    pub drafted_tokens: u32,
    pub accepted_tokens: u32,
    pub verifications: u32,
    pub acceptance_rate: f64,
    pub mean_accepted_length: f64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// The assistant's message in a chat completion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: &'static str,
    pub content: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    /// Always null: log probabilities are not returned.
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<()>,
    pub finish_reason: Option<Finish>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    /// Always null: log probabilities are not returned.
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<()>,
    pub finish_reason: Option<Finish>,
}

/// A completion without `stream`: `chat.completion` (of `ChatChoice`s) or `text_completion`
/// (of `TextChoice`s).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Completion<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    pub usage: Usage,
    pub routing: Routing,
}

/// What a chat chunk adds to its choice: the role first, then text.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct Delta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: Delta,
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<()>,
    pub finish_reason: Option<Finish>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TextChunkChoice {
    pub index: usize,
    pub text: String,
    #[schema(value_type = Option<Object>)]
    pub logprobs: Option<()>,
    pub finish_reason: Option<Finish>,
}

/// A chunk's routing: the models of its tokens, or in a choice's last chunk, the outcome.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ChunkRouting {
    Tokens {
        /// The model that generated each token of the chunk.
        models: Vec<String>,
    },
    Outcome(Routing),
}

/// One `data:` event of a streamed completion (`chat.completion.chunk` or
/// `text_completion`); the stream ends with `data: [DONE]`. With
/// `stream_options.include_usage`, a last chunk with no choices carries `usage`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Chunk<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub routing: Option<ChunkRouting>,
}

/// One server-sent event of a streamed chat completion: `data` holds a
/// `Chunk_ChatChunkChoice` as JSON, an `ErrorBody` if the stream fails, and `[DONE]` last.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only: streams are written event by event
pub struct ChatStreamEvent {
    data: String,
}

/// One server-sent event of a streamed text completion: `data` holds a
/// `Chunk_TextChunkChoice` as JSON, an `ErrorBody` if the stream fails, and `[DONE]` last.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only
pub struct TextStreamEvent {
    data: String,
}

/// One server-sent event of a streamed `/generate`: `data` holds a `GenerateResponse` (the
/// text so far) as JSON, an `ErrorBody` if the stream fails, and `[DONE]` last.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only
pub struct GenerateStreamEvent {
    data: String,
}

/// Each stream event's schema and the schema of the JSON its `data` carries.
pub const STREAM_EVENTS: [(&str, &str); 3] = [
    ("ChatStreamEvent", "Chunk_ChatChunkChoice"),
    ("TextStreamEvent", "Chunk_TextChunkChoice"),
    ("GenerateStreamEvent", "GenerateResponse"),
];

/// What a `/generate` stop matched: the stop string, or the token that ended it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum Matched {
    Text(String),
    Token(u32),
}

/// SGLang's finish reason.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum GenerateFinish {
    Stop { matched: Option<Matched> },
    Length { length: usize },
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MetaInfo {
    pub id: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Null until the request ends.
    pub finish_reason: Option<GenerateFinish>,
    /// Seconds from arrival to the end; null until then.
    pub e2e_latency: Option<f64>,
    pub routing: Option<Routing>,
}

/// `POST /generate`, whole or as each `data:` event of its stream (text so far).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct GenerateResponse {
    pub text: String,
    pub output_ids: Vec<u32>,
    pub meta_info: MetaInfo,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// For a model of the routed set: the served model it belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

/// `GET /v1/models`: the served model, then each model of the routed set.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

/// `POST /cache/match`: how much of a prompt the first model holds in its prefix cache.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CacheMatch {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub block_size: usize,
}

/// `GET /health` when a model is down.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Unhealthy {
    /// Always `unhealthy`.
    pub status: &'static str,
    pub model: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelInfo {
    pub name: String,
    pub path: String,
    /// `slm` or `llm`; null for a model without a role.
    pub role: Option<String>,
    pub batch_threshold: usize,
    /// The subserver's address, for a model served remotely.
    pub remote: Option<String>,
    /// The KV cache's share of the memory budget (null for a remote model).
    pub kv_blocks: Option<usize>,
    pub kv_tokens: Option<usize>,
    pub kv_bytes: Option<usize>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SchedulerInfo {
    pub mode: String,
    pub thresholds: String,
    pub max_wait_ms: u64,
    pub max_batch_tokens: usize,
    pub max_batch_requests: usize,
}

/// `GET /get_server_info`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ServerInfo {
    pub served_model: String,
    pub models: Vec<ModelInfo>,
    pub routing: String,
    pub scheduler: SchedulerInfo,
    pub kv_budget_mb: f64,
    pub block_size: usize,
    pub max_context: usize,
    pub max_requests: usize,
}

/// The error object of an OpenAI-style error body.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `overloaded_error` or
    /// `internal_server_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, when one is (`messages[1].content`).
    pub param: Option<String>,
    /// A code such as `model_not_found`, else the HTTP status.
    pub code: String,
}

/// Every error: `{"error": {...}}`; also the last event of a stream that fails.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}
