//! The routing text of a request: the raw characters a worker's prefix cache would see first.
//! For chat it is the whole conversation (every message, in order), not the first message;
//! for completions the prompt; for `/generate` the text or the token ids.

use serde_json::Value;

use crate::server::schema::RequestApi;

/// Which API a body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
    Generate,
}

impl Endpoint {
    /// The server's name for the API, which parses its bodies.
    pub fn api(self) -> RequestApi {
        match self {
            Self::Chat => RequestApi::Chat,
            Self::Completion => RequestApi::Completion,
            Self::Generate => RequestApi::Generate,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Self::Chat => "/v1/chat/completions",
            Self::Completion => "/v1/completions",
            Self::Generate => "/generate",
        }
    }
}

/// Appends the text of a content value: a string, or an array of parts with `text`.
fn push_content(out: &mut String, content: &Value) {
    match content {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for part in parts {
                match part {
                    Value::String(s) => out.push_str(s),
                    other => push_content(out, other.get("text").unwrap_or(&Value::Null)),
                }
            }
        }
        _ => {}
    }
}

/// Appends a prompt given as a string, a list of strings, or token ids.
fn push_prompt(out: &mut String, prompt: &Value) {
    match prompt {
        Value::String(s) => out.push_str(s),
        Value::Number(n) => {
            out.push_str(&n.to_string());
            out.push(' ');
        }
        Value::Array(items) => items.iter().for_each(|item| push_prompt(out, item)),
        _ => {}
    }
}

pub fn routing_text(endpoint: Endpoint, body: &Value) -> String {
    let mut out = String::new();
    match endpoint {
        Endpoint::Chat => {
            for message in body["messages"].as_array().into_iter().flatten() {
                out.push_str(message["role"].as_str().unwrap_or(""));
                out.push('\n');
                push_content(&mut out, &message["content"]);
                out.push('\n');
            }
        }
        Endpoint::Completion => push_prompt(&mut out, &body["prompt"]),
        Endpoint::Generate => match body.get("text") {
            Some(text) => push_prompt(&mut out, text),
            None => push_prompt(&mut out, &body["input_ids"]),
        },
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn chat_text_is_the_whole_conversation() {
        let body = json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]});
        assert_eq!(
            routing_text(Endpoint::Chat, &body),
            "system\nYou are terse.\nuser\nHi there\nassistant\nHello.\nuser\nBye\n"
        );
    }

    #[test]
    fn conversations_sharing_a_system_prompt_share_a_prefix() {
        let a = json!({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}]});
        let b = json!({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "b"}]});
        let (a, b) = (
            routing_text(Endpoint::Chat, &a),
            routing_text(Endpoint::Chat, &b),
        );
        assert_eq!(a[..a.len() - 2], b[..b.len() - 2]);
        assert_ne!(a, b);
    }

    #[test]
    fn prompts_and_generate_bodies_are_read_in_every_form() {
        assert_eq!(
            routing_text(Endpoint::Completion, &json!({"prompt": "abc"})),
            "abc"
        );
        assert_eq!(
            routing_text(Endpoint::Completion, &json!({"prompt": ["a", "b"]})),
            "ab"
        );
        assert_eq!(
            routing_text(Endpoint::Completion, &json!({"prompt": [1, 2]})),
            "1 2 "
        );
        assert_eq!(
            routing_text(Endpoint::Generate, &json!({"text": "xyz"})),
            "xyz"
        );
        assert_eq!(
            routing_text(Endpoint::Generate, &json!({"input_ids": [7]})),
            "7 "
        );
        assert_eq!(routing_text(Endpoint::Chat, &json!({})), "");
    }
}
