//! Request bodies of the OpenAI API (`/v1/chat/completions`, `/v1/completions`) and of
//! SGLang's native `/generate`, and their conversion into runtime requests. Parsing names the
//! field at fault; unknown fields are ignored, as OpenAI-compatible servers do.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use utoipa::ToSchema;

use super::error::ApiError;
pub use super::sampling::SamplingFields;
use crate::actors::{GenerateRequest, Prompt};
use crate::model::{ChatMessage, SamplingParams};

/// Parses a JSON body, naming the field whose value is wrong.
/// Which generation API a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RequestApi {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Completion,
    /// `/generate`
    Generate,
}

impl RequestApi {
    /// The request a body for this API asks for, checked as the API's handler checks it.
    pub fn parse_request(self, body: &[u8]) -> Result<GenerateRequest, ApiError> {
        match self {
            Self::Chat => ChatRequest::parse(body)?.to_request(),
            Self::Completion => CompletionRequest::parse(body)?.to_request(),
            Self::Generate => parse::<GenerateBody>(body)?.to_request(),
        }
    }
}

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

/// A model name this server answers to: the document a server publishes lists its own.
#[derive(ToSchema)]
#[allow(dead_code)] // a schema only: requests carry the name as a string
pub struct ModelName(String);

/// A token id of the served tokenizer: the document a server publishes states its vocabulary.
#[derive(Debug, Clone, Copy, Deserialize, ToSchema)]
#[serde(transparent)]
pub struct TokenId(pub u32);

fn ids(tokens: &[TokenId]) -> Vec<u32> {
    tokens.iter().map(|t| t.0).collect()
}

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, ToSchema)]
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

/// The sampling fields of both OpenAI endpoints.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct OpenAiSampling {
    #[serde(flatten)]
    pub fields: SamplingFields,
    pub stop: Option<Stop>,
    /// Choices to generate. Default 1.
    #[schema(minimum = 1, maximum = 16)]
    pub n: Option<usize>,
    pub ignore_eos: Option<bool>,
    /// Only `false` (or null): log probabilities are not returned yet.
    #[schema(value_type = Option<bool>)]
    pub logprobs: Option<serde_json::Value>,
    pub top_logprobs: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// The served model's name or one of the routed set's (`GET /v1/models`); absent: the
    /// served model.
    #[schema(value_type = Option<ModelName>)]
    pub model: Option<String>,
    #[schema(min_items = 1, value_type = Vec<MessageShape>)]
    pub messages: Vec<ChatMessageIn>,
    /// Most tokens to generate; absent: up to the context.
    #[schema(minimum = 1)]
    pub max_tokens: Option<usize>,
    /// Takes precedence over `max_tokens`.
    #[schema(minimum = 1)]
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
}

/// The message roles of OpenAI's chat API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::Developer => "developer",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

/// A chat message; only an assistant's may omit its content. (Parsed as a struct so that an
/// error names `role` or `content`; [`MessageShape`] states the rule for the document.)
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: Role,
    pub content: Option<Content>,
}

/// A chat message as the document states it, one shape per role: what [`ChatRequest`]'s
/// checks accept (a unit test holds the two together).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum MessageShape {
    System { content: Content },
    Developer { content: Content },
    User { content: Content },
    Assistant { content: Option<Content> },
    Tool { content: Content },
}

/// Message content: a string, or a list of text parts.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// A content part; only `text` parts are supported. (Parsed loosely so that an unsupported
/// part is named as such.)
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    #[schema(value_type = PartKind)]
    pub kind: String,
    #[schema(value_type = String, required = true)]
    pub text: Option<String>,
}

/// The content part types supported.
#[derive(ToSchema)]
#[serde(rename_all = "lowercase")]
#[allow(dead_code)] // a schema only: `ContentPart` reads the type as a string
pub enum PartKind {
    Text,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// As in a chat request.
    #[schema(value_type = Option<ModelName>)]
    pub model: Option<String>,
    pub prompt: CompletionPrompt,
    /// Most tokens to generate. Default 16.
    #[schema(minimum = 1)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// Only `false`: echoing the prompt is not supported.
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub sampling: OpenAiSampling,
}

/// `prompt`: a string, token ids, or a batch of one of either.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum CompletionPrompt {
    Text(String),
    Tokens(Vec<TokenId>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<TokenId>>),
}

/// SGLang's `POST /generate`: exactly one of `text` and `input_ids`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct GenerateBody {
    pub text: Option<String>,
    #[schema(value_type = Option<Vec<TokenId>>, min_items = 1)]
    pub input_ids: Option<Vec<u32>>,
    /// Read once the body is known to be an object, naming `sampling_params.field` on error.
    #[serde(default)]
    #[schema(value_type = Option<NativeSampling>)]
    pub sampling_params: serde_json::Value,
    #[serde(default)]
    pub stream: bool,
}

/// `sampling_params` of `/generate`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct NativeSampling {
    /// Default 128.
    #[schema(minimum = 1)]
    pub max_new_tokens: Option<usize>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(flatten)]
    pub fields: SamplingFields,
}

/// Largest `n` a request may ask for.
pub const MAX_N: usize = 16;

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

/// An OpenAI body: the sampling fields are read on their own first, so that an error in one
/// names its field (a flattened field's error would not).
fn parse_openai<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let body = json(body)?;
    read::<SamplingFields>(&body, None)?;
    read::<OpenAiSampling>(&body, None)?;
    read(&body, None)
}

impl ChatRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse_openai(body)
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
                let field = format!("messages[{i}].content");
                let content = match &m.content {
                    // Only an assistant turn may come without content (OpenAI's carries tool
                    // calls then, which are not supported here: it renders empty).
                    None if m.role == Role::Assistant => String::new(),
                    None => {
                        return Err(ApiError::invalid(
                            &field,
                            format!("{field}: required for a '{}' message", m.role.name()),
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
                Ok(ChatMessage::new(m.role.name(), &content))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Both limits are checked, though the first wins: a request is valid or not as a whole.
        for (field, limit) in [
            ("max_completion_tokens", self.max_completion_tokens),
            ("max_tokens", self.max_tokens),
        ] {
            if limit == Some(0) {
                return Err(ApiError::invalid(
                    field,
                    format!("{field}: must be at least 1"),
                ));
            }
        }
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        self.sampling.request(Prompt::Chat(messages), max_tokens)
    }
}

impl CompletionRequest {
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        parse_openai(body)
    }

    pub fn to_request(&self) -> Result<GenerateRequest, ApiError> {
        let prompt = match &self.prompt {
            CompletionPrompt::Text(t) => Prompt::Text(t.clone()),
            CompletionPrompt::Tokens(t) => Prompt::Tokens(ids(t)),
            CompletionPrompt::Texts(v) if v.len() == 1 => Prompt::Text(v[0].clone()),
            CompletionPrompt::TokenLists(v) if v.len() == 1 => Prompt::Tokens(ids(&v[0])),
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
        read_nested::<SamplingFields>(&self.sampling_params, "sampling_params")?;
        let s: NativeSampling = read_nested(&self.sampling_params, "sampling_params")?;
        Ok(GenerateRequest {
            prompt,
            params: s.fields.params()?,
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
            (ChatRequest::parse(body).and_then(|r| r.to_request()))
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

    /// The document's per-role message shapes accept exactly the messages the checks do.
    #[test]
    fn message_shapes_match_the_checks() {
        let contents = [
            None,
            Some(r#""hi""#),
            Some(r#"[{"type": "text", "text": "a"}]"#),
        ];
        for role in ["system", "developer", "user", "assistant", "tool", "wizard"] {
            for content in contents {
                let message = match content {
                    Some(c) => format!(r#"{{"role": "{role}", "content": {c}}}"#),
                    None => format!(r#"{{"role": "{role}"}}"#),
                };
                let shape = serde_json::from_str::<MessageShape>(&message).is_ok();
                let body = format!(r#"{{"messages": [{message}]}}"#);
                let checked = ChatRequest::parse(body.as_bytes()).and_then(|r| r.to_request());
                assert_eq!(shape, checked.is_ok(), "{message}");
            }
        }
    }
}
