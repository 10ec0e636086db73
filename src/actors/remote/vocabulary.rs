//! A model's vocabulary as it crosses a link: whole, for a front that reads and writes
//! requests with it, or as a digest, to check that two models tokenize alike.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::{ChatTemplate, SpecialTokens, Vocabulary};

/// A [`Vocabulary`] as it crosses: the tokenizer as its JSON, the chat template as its source.
#[derive(Clone, Serialize, Deserialize)]
pub struct WireVocabulary {
    tokenizer: String,
    bos: Option<u32>,
    eos: Vec<u32>,
    bos_text: Option<String>,
    eos_text: Option<String>,
    /// Source, BOS text, EOS text.
    chat_template: Option<(String, String, String)>,
}

impl std::fmt::Debug for WireVocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "WireVocabulary({} bytes of tokenizer)",
            self.tokenizer.len()
        )
    }
}

impl WireVocabulary {
    pub fn of(v: &Vocabulary) -> Result<Self, String> {
        Ok(Self {
            tokenizer: v.tokenizer.to_string(false).map_err(|e| e.to_string())?,
            bos: v.special.bos,
            eos: v.special.eos.clone(),
            bos_text: v.special.bos_text.clone(),
            eos_text: v.special.eos_text.clone(),
            chat_template: v.chat_template.as_ref().map(|t| {
                let (source, bos, eos) = t.parts();
                (source.to_string(), bos.to_string(), eos.to_string())
            }),
        })
    }

    pub fn into_vocabulary(self) -> Result<Vocabulary, String> {
        let tokenizer: tokenizers::Tokenizer = self
            .tokenizer
            .parse()
            .map_err(|e| format!("the subserver's tokenizer: {e}"))?;
        let chat_template = self
            .chat_template
            .map(|(source, bos, eos)| ChatTemplate::new(&source, Some(&bos), Some(&eos)))
            .transpose()
            .map_err(|e| format!("the subserver's chat template: {e}"))?;
        Ok(Vocabulary {
            tokenizer,
            special: SpecialTokens {
                bos: self.bos,
                eos: self.eos,
                bos_text: self.bos_text,
                eos_text: self.eos_text,
            },
            chat_template,
        })
    }
}

/// A digest of a vocabulary (every token and its id): equal digests, equal vocabularies.
pub fn vocab_digest(tokenizer: &tokenizers::Tokenizer) -> [u8; 32] {
    let mut vocab: Vec<(u32, String)> = tokenizer
        .get_vocab(true)
        .into_iter()
        .map(|(t, id)| (id, t))
        .collect();
    vocab.sort_unstable();
    let mut hash = Sha256::new();
    for (id, token) in vocab {
        hash.update(id.to_le_bytes());
        hash.update((token.len() as u64).to_le_bytes());
        hash.update(token.as_bytes());
    }
    hash.finalize().into()
}
