//! Request bodies of the OpenAI API (`/v1/chat/completions`, `/v1/completions`) and of
//! SGLang's native `/generate`, and their conversion into runtime requests. Parsing names the
//! field at fault; unknown fields are ignored, as OpenAI-compatible servers do.

use serde::de::DeserializeOwned;
use serde::Deserialize;

use super::error::ApiError;
use crate::actors::{GenerateRequest, Prompt};
use crate::model::{ChatMessage, SamplingParams};

/// Parses a JSON body, naming the field whose value is wrong.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    read(&json(body)?, None)
}

/// The body's bytes parsed once; each endpoint then reads its parts from the value. (Parts
/// rather than one struct with `#[serde(flatten)]`, which would hide the field name of an
/// error.)
fn json(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid("body", format!("the body is not a valid JSON request: {e}"))
    })
}

/// Reads `T` from a parsed body (`prefix` `None`) or from its nested object `prefix`, naming
/// `prefix.field` on error.
fn read<T: DeserializeOwned>(
    value: &serde_json::Value,
    prefix: Option<&str>,
) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let inner = e.path().to_string();
        let path = match prefix {
            Some(prefix) => format!("{prefix}.{inner}"),
            None if inner == "." => {
                let message = format!("the body is not a valid JSON request: {}", e.into_inner());
                return ApiError::invalid("body", message);
            }
            None => inner,
        };
        ApiError::invalid(&path, format!("{path}: {}", e.into_inner()))
    })
}

/// Reads a nested object (`null` or absent: the defaults), naming `prefix.field` on error.
fn read_nested<T: DeserializeOwned + Default>(
    value: &serde_json::Value,
    prefix: &str,
) -> Result<T, ApiError> {
    if value.is_null() {
        return Ok(T::default());
    }
    read(value, Some(prefix))
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    fn into_vec(self) -> Vec<String> {
        match self {
            Self::One(s) => vec![s],
            Self::Many(v) => v,
        }
    }
}

/// Sampling fields every endpoint shares; absent ones take the sampler's defaults.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// The sampling fields of both OpenAI endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct OpenAiSampling {
    #[serde(skip)]
    pub fields: SamplingFields,
    pub stop: Option<Stop>,
    pub n: Option<usize>,
    pub ignore_eos: Option<bool>,
    pub logprobs: Option<serde_json::Value>,
    pub top_logprobs: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(skip)]
    pub sampling: OpenAiSampling,
}

/// The message roles OpenAI's chat API accepts.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Content>,
}

/// Message content: a string, or a list of parts of which the text ones are used.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: CompletionPrompt,
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub echo: bool,
    #[serde(skip)]
    pub sampling: OpenAiSampling,
}

/// `prompt`: a string, token ids, or a batch of one of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum CompletionPrompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// SGLang's `/generate`.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerateBody {
    pub text: Option<String>,
    pub input_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub sampling_params: serde_json::Value,
    #[serde(default)]
    pub stream: bool,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct NativeSampling {
    pub max_new_tokens: Option<usize>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub ignore_eos: bool,
}

/// Largest `n` a request may ask for.
pub const MAX_N: usize = 16;

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
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_p: self.top_p.unwrap_or(d.top_p),
            top_k,
            min_p: self.min_p.unwrap_or(d.min_p),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
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

impl OpenAiSampling {
    fn params(&self) -> Result<SamplingParams, ApiError> {
        if self
            .logprobs
            .as_ref()
            .is_some_and(|v| v != &serde_json::Value::Bool(false) && !v.is_null())
        {
            return Err(ApiError::invalid(
                "logprobs",
                "logprobs: not supported by this server yet",
            ));
        }
        self.fields.params()
    }

    /// `n` validated.
    pub fn n(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            n @ 1..=MAX_N => Ok(n),
            n => Err(ApiError::invalid(
                "n",
                format!("n: {n} must be between 1 and {MAX_N}"),
            )),
        }
    }

    fn request(
        &self,
        prompt: Prompt,
        max_tokens: Option<usize>,
    ) -> Result<GenerateRequest, ApiError> {
        Ok(GenerateRequest {
            prompt,
            params: self.params()?,
            max_tokens,
            stop: self.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }
}

/// An OpenAI body, parsed once: the endpoint's own fields and the sampling fields.
fn parse_openai<T: DeserializeOwned>(body: &[u8]) -> Result<(T, OpenAiSampling), ApiError> {
    let body = json(body)?;
    let request = read(&body, None)?;
    let mut sampling: OpenAiSampling = read(&body, None)?;
    sampling.fields = read(&body, None)?;
    Ok((request, sampling))
}

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let (request, sampling) = parse_openai::<Self>(body)?;
        Ok(Self {
            sampling,
            ..request
        })
    }

    pub fn to_request(&self) -> Result<GenerateRequest, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "messages: at least one message is required",
            ));
        }
        let messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                if !ROLES.contains(&m.role.as_str()) {
                    return Err(ApiError::invalid(
                        &format!("messages[{i}].role"),
                        format!(
                            "messages[{i}].role: '{}' is not one of {}",
                            m.role,
                            ROLES.join(", ")
                        ),
                    ));
                }
                let field = format!("messages[{i}].content");
                let content = match &m.content {
                    // Only an assistant turn may come without content (OpenAI's carries tool
                    // calls then, which are not supported here: it renders empty).
                    None if m.role == "assistant" => String::new(),
                    None => {
                        return Err(ApiError::invalid(
                            &field,
                            format!("{field}: required for a '{}' message", m.role),
                        ))
                    }
                    Some(Content::Text(t)) => t.clone(),
                    Some(Content::Parts(parts)) => {
                        if let Some(p) = parts.iter().find(|p| p.kind != "text") {
                            return Err(ApiError::invalid(
                                &field,
                                format!(
                                    "{field}: part type '{}' is not supported (text only)",
                                    p.kind
                                ),
                            ));
                        }
                        if let Some(j) = parts.iter().position(|p| p.text.is_none()) {
                            return Err(ApiError::invalid(
                                &format!("{field}[{j}].text"),
                                format!("{field}[{j}].text: a text part needs its text"),
                            ));
                        }
                        parts.iter().filter_map(|p| p.text.as_deref()).collect()
                    }
                };
                Ok(ChatMessage::new(&m.role, &content))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        self.sampling.request(Prompt::Chat(messages), max_tokens)
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let (request, sampling) = parse_openai::<Self>(body)?;
        Ok(Self {
            sampling,
            ..request
        })
    }

    pub fn to_request(&self) -> Result<GenerateRequest, ApiError> {
        let prompt = match &self.prompt {
            CompletionPrompt::Text(t) => Prompt::Text(t.clone()),
            CompletionPrompt::Tokens(ids) => Prompt::Tokens(ids.clone()),
            CompletionPrompt::Texts(v) if v.len() == 1 => Prompt::Text(v[0].clone()),
            CompletionPrompt::TokenLists(v) if v.len() == 1 => Prompt::Tokens(v[0].clone()),
            _ => return Err(ApiError::invalid(
                "prompt",
                "prompt: batches of several prompts are not supported; send one request per prompt",
            )),
        };
        if self.echo {
            return Err(ApiError::invalid(
                "echo",
                "echo: not supported by this server",
            ));
        }
        self.sampling.request(prompt, self.max_tokens)
    }
}

impl GenerateBody {
    pub fn to_request(&self) -> Result<GenerateRequest, ApiError> {
        let prompt = match (&self.text, &self.input_ids) {
            (Some(t), None) => Prompt::Text(t.clone()),
            (None, Some(ids)) => Prompt::Tokens(ids.clone()),
            _ => {
                return Err(ApiError::invalid(
                    "text",
                    "text: give exactly one of text and input_ids",
                ))
            }
        };
        let s: NativeSampling = read_nested(&self.sampling_params, "sampling_params")?;
        let fields: SamplingFields = read_nested(&self.sampling_params, "sampling_params")?;
        Ok(GenerateRequest {
            prompt,
            params: fields.params()?,
            max_tokens: Some(s.max_new_tokens.unwrap_or(128)),
            stop: s.stop.clone().map(Stop::into_vec).unwrap_or_default(),
            ignore_eos: s.ignore_eos,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_types_name_the_field() {
        let e = ChatRequest::parse(br#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"), "{e}");
        let e =
            ChatRequest::parse(br#"{"messages": [{"role": "user", "content": 5}]}"#).unwrap_err();
        assert!(e.message.contains("messages[0].content"), "{e}");
        let body = br#"{"text": "a", "sampling_params": {"top_p": "x"}}"#;
        let e = parse::<GenerateBody>(body)
            .unwrap()
            .to_request()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sampling_params.top_p"), "{e}");
        let e = ChatRequest::parse(b"{not json").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("body"));
    }

    /// As OpenAI's API: an unknown role, and a message other than the assistant's without
    /// content, are rejected naming the field; an assistant turn may omit its content.
    #[test]
    fn roles_and_required_content_are_checked() {
        let param = |body: &[u8]| {
            ChatRequest::parse(body)
                .unwrap()
                .to_request()
                .err()
                .and_then(|e| e.param)
        };
        assert_eq!(
            param(br#"{"messages": [{"role": "wizard", "content": "hi"}]}"#).as_deref(),
            Some("messages[0].role")
        );
        assert_eq!(
            param(br#"{"messages": [{"role": "system", "content": "s"}, {"role": "user"}]}"#)
                .as_deref(),
            Some("messages[1].content")
        );
        assert_eq!(
            param(br#"{"messages": [{"role": "user", "content": [{"type": "text"}]}]}"#).as_deref(),
            Some("messages[0].content[0].text")
        );
        let ok = br#"{"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "q"}, {"role": "assistant", "content": null}]}"#;
        assert_eq!(param(ok), None);
    }

    #[test]
    fn chat_requests_convert_with_their_sampling() {
        let req = ChatRequest::parse(
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 7, "temperature": 0, "stop": "x", "top_k": -1, "user": "ignored"}"#,
        )
        .unwrap();
        let r = req.to_request().unwrap();
        assert_eq!(r.max_tokens, Some(7));
        assert_eq!(r.stop, ["x"]);
        assert_eq!(r.params.temperature, 0.0);
        assert!(matches!(r.prompt, Prompt::Chat(ref m) if m.len() == 1));
    }

    #[test]
    fn bad_sampling_values_are_rejected_by_name() {
        let req = ChatRequest::parse(
            br#"{"messages": [{"role": "user", "content": "hi"}], "top_p": -1}"#,
        )
        .unwrap();
        assert_eq!(
            req.to_request().unwrap_err().param.as_deref(),
            Some("top_p")
        );
        let req = ChatRequest::parse(br#"{"messages": []}"#).unwrap();
        assert_eq!(
            req.to_request().unwrap_err().param.as_deref(),
            Some("messages")
        );
        let req = CompletionRequest::parse(br#"{"prompt": "a", "n": 100}"#).unwrap();
        assert_eq!(req.sampling.n().unwrap_err().param.as_deref(), Some("n"));
    }

    #[test]
    fn generate_takes_text_or_input_ids() {
        let body: GenerateBody =
            parse(br#"{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}"#).unwrap();
        let r = body.to_request().unwrap();
        assert_eq!(r.max_tokens, Some(3));
        let body: GenerateBody = parse(br#"{"sampling_params": {}}"#).unwrap();
        assert_eq!(
            body.to_request().unwrap_err().param.as_deref(),
            Some("text")
        );
    }
}
