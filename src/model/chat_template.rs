//! The checkpoint's own chat template (`tokenizer.chat_template`), rendered with minijinja the
//! way Hugging Face `apply_chat_template` renders it: `messages`, `add_generation_prompt`,
//! `bos_token`, `eos_token`, Python string methods, `raise_exception`, loop controls, and
//! `trim_blocks` / `lstrip_blocks` on.

use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use super::error::{ModelError, Result};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

fn raise_exception(msg: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self> {
        let mut env = Environment::new();
        // Hugging Face renders chat templates with trim_blocks and lstrip_blocks on.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(format!("cannot parse the template: {e}")))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
        })
    }

    /// The template's source and its BOS and EOS texts, as [`ChatTemplate::new`] takes them.
    pub fn parts(&self) -> (&str, &str, &str) {
        (&self.source, &self.bos_token, &self.eos_token)
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(ModelError::Template("no messages to render".into()));
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => Value::from_serialize(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(|e| ModelError::Template(format!("cannot render: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn chatml_template_renders_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, None, None).unwrap();
        let out = t
            .render(
                &[
                    ChatMessage::new("system", "Be brief."),
                    ChatMessage::new("user", "Hi"),
                ],
                true,
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new(
            "{{ messages[0]['content'].strip().upper() }}{{ eos_token }}",
            None,
            Some("</s>"),
        )
        .unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi ")], false)
                .unwrap(),
            "HI</s>"
        );
    }

    #[test]
    fn raise_exception_becomes_a_template_error() {
        let t =
            ChatTemplate::new("{{ raise_exception('roles must alternate') }}", None, None).unwrap();
        let err = t
            .render(&[ChatMessage::new("user", "x")], true)
            .unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn broken_template_is_rejected_at_load() {
        assert!(ChatTemplate::new("{% for %}", None, None).is_err());
    }
}
