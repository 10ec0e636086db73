//! What every request actor shares ([`RuntimeShared`]: the model actors, the tokenizer, the
//! routing function, the limits a request is checked against) and the caller's side of a
//! submitted request ([`RequestHandle`]). The runtime builds the shared part once; requests
//! never reach back into the runtime.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use actix::{Actor, Addr};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::{
    Cancel, ErrorKind, GenerateRequest, Prompt, RequestActor, RequestError, RequestEvent, Summary,
};
use crate::actors::model_actor::ModelAddr;
use crate::model::Vocabulary;
use crate::routing::{ModelIndex, RoutingAlgorithm};
use crate::scheduler::{PublishedPrefixes, RequestId};

/// What request actors share: the model actors, the tokenizer and the routing function.
pub struct RuntimeShared {
    pub model_names: Vec<String>,
    pub models: Vec<ModelAddr>,
    /// The model whose tokenizer and chat template requests use (all routed models share the
    /// tokenizer).
    pub lead: Arc<Vocabulary>,
    pub eos: Vec<u32>,
    pub vocab_size: usize,
    pub router: Arc<dyn RoutingAlgorithm>,
    /// Longest sequence every model can hold (context length and KV share).
    pub max_context: usize,
    /// Per model: false once a forward pass panicked, or while its subserver is unreachable.
    pub health: Vec<Arc<AtomicBool>>,
    /// Per model: false while its subserver is unreachable (new requests then get
    /// [`ErrorKind::Unavailable`]); a local model's stays true.
    pub linked: Vec<Arc<AtomicBool>>,
    /// Per model: the prefixes its KV cache holds, as of its last step.
    pub prefixes: Vec<Arc<PublishedPrefixes>>,
    pub block_size: usize,
    pub(in crate::actors) next_id: AtomicU64,
}

/// A validated request: its prompt tokens and output budget.
pub struct Admitted {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
}

impl RuntimeShared {
    /// The first model whose actor failed, if any.
    pub fn unhealthy_model(&self) -> Option<&str> {
        self.health
            .iter()
            .position(|h| !h.load(Ordering::Acquire))
            .map(|i| self.model_names[i].as_str())
    }

    /// Tokenizes and validates, naming the field at fault.
    pub fn prepare(&self, request: &GenerateRequest) -> Result<Admitted, RequestError> {
        if let Some(i) = self
            .linked
            .iter()
            .position(|up| !up.load(Ordering::Acquire))
        {
            let name = &self.model_names[i];
            return Err(RequestError {
                kind: ErrorKind::Unavailable,
                message: format!("model '{name}' is unavailable; retry shortly"),
            });
        }
        request
            .params
            .validate()
            .map_err(|e| RequestError::invalid(e.to_string()))?;
        if let Prompt::Tokens(ids) = &request.prompt {
            if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
                return Err(RequestError::invalid(format!(
                    "input_ids: token {bad} is outside the vocabulary (size {})",
                    self.vocab_size
                )));
            }
        }
        let prompt = prompt_tokens(&self.lead, &request.prompt)?;
        if prompt.is_empty() {
            return Err(RequestError::invalid("prompt: the prompt is empty"));
        }
        let room = self.max_context.saturating_sub(prompt.len());
        if room == 0 {
            return Err(RequestError::invalid(format!(
                "prompt: {} tokens do not fit the context of {} tokens",
                prompt.len(),
                self.max_context
            )));
        }
        let max_tokens = match request.max_tokens {
            None => room,
            Some(0) => return Err(RequestError::invalid("max_tokens: must be at least 1")),
            Some(n) if n > room => {
                return Err(RequestError::invalid(format!(
                    "max_tokens: {n} plus the prompt's {} tokens exceed the context of {} tokens",
                    prompt.len(),
                    self.max_context
                )))
            }
            Some(n) => n,
        };
        Ok(Admitted { prompt, max_tokens })
    }

    /// Prompt tokens of `request` and how many of them the first model holds in its prefix
    /// cache (as of its last step).
    pub fn cached_prefix(&self, request: &GenerateRequest) -> Result<(usize, usize), RequestError> {
        let prompt = self.prepare(request)?.prompt;
        let first = self.router.first_model(&prompt);
        let cached = self.prefixes[first].cached_tokens(&prompt, self.block_size);
        Ok((prompt.len(), cached))
    }
}

/// The tokens of a prompt as `vocab` gives them: text tokenized (special tokens written in
/// it recognised), a conversation rendered with the chat template first, token ids as they
/// are. The server and a gateway that routes on token blocks tokenize alike through this.
pub fn prompt_tokens(vocab: &Vocabulary, prompt: &Prompt) -> Result<Vec<u32>, RequestError> {
    let encode = |text: &str| {
        let enc = vocab
            .tokenizer
            .encode(text, true)
            .map_err(|e| RequestError {
                kind: ErrorKind::Internal,
                message: format!("tokenizer: {e}"),
            })?;
        Ok(enc.get_ids().to_vec())
    };
    match prompt {
        Prompt::Text(text) => encode(text),
        Prompt::Chat(messages) => {
            let template = vocab
                .chat_template
                .as_ref()
                .ok_or_else(|| RequestError::invalid("messages: the model has no chat template"))?;
            let text = template
                .render(messages, true)
                .map_err(|e| RequestError::invalid(format!("messages: {e}")))?;
            encode(&text)
        }
        Prompt::Tokens(ids) => Ok(ids.clone()),
    }
}

impl RuntimeShared {
    /// Starts a request actor for `request` on the current arbiter.
    pub fn submit(self: &Arc<Self>, request: GenerateRequest) -> RequestHandle {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, events) = unbounded_channel();
        let actor = RequestActor::new(self.clone(), id, request, tx).start();
        RequestHandle { id, events, actor }
    }
}

/// A submitted request: its events, ending with exactly one terminal event.
pub struct RequestHandle {
    pub id: RequestId,
    pub events: UnboundedReceiver<RequestEvent>,
    actor: Addr<RequestActor>,
}

impl RequestHandle {
    pub fn cancel(&self) {
        self.actor.do_send(Cancel);
    }

    /// Reads the request's events to its end, handing each piece of text and its tokens (with
    /// the model that made each) to `on_text`. Returns the summary, `None` when the request
    /// was cancelled, or the error that ended it.
    pub async fn finish(
        mut self,
        mut on_text: impl FnMut(&str, &[(u32, ModelIndex)]),
    ) -> Result<Option<Summary>, RequestError> {
        while let Some(event) = self.events.recv().await {
            match event {
                RequestEvent::Text { text, tokens } => on_text(&text, &tokens),
                RequestEvent::Finished(summary) => return Ok(Some(summary)),
                RequestEvent::Failed(e) => return Err(e),
                RequestEvent::Cancelled => return Ok(None),
                RequestEvent::Admitted { .. } | RequestEvent::Moved { .. } => {}
            }
        }
        Err(RequestError {
            kind: ErrorKind::Internal,
            message: "the request ended without a terminal event".into(),
        })
    }
}
