//! Tokenizers built from GGUF metadata, and the GGUF chat templates, against golden output of
//! Hugging Face transformers' own GGUF conversion and Jinja2 rendering
//! (`scripts/make-tokenizer-golden.py` wrote `tests/golden/tokenizer.json`).

mod common;

use candle_core::Device;
use common::*;
use serde::Deserialize;
use tokenrouter::model::gguf::GgufFile;
use tokenrouter::model::{tokenizer, ChatMessage, ChatTemplate};

#[derive(Deserialize)]
struct Encoded {
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

#[derive(Deserialize)]
struct Chat {
    messages: Vec<ChatMessage>,
    rendered: String,
}

#[derive(Deserialize)]
struct Golden {
    encode: Vec<Encoded>,
    chat: Vec<Chat>,
}

fn check(name: &str) {
    let all: std::collections::HashMap<String, Golden> =
        serde_json::from_str(include_str!("golden/tokenizer.json")).unwrap();
    let golden = &all[name];
    let file = GgufFile::open(&real_model(name), &Device::Cpu).unwrap();
    let md = file.metadata();
    let (tok, special) = tokenizer::from_gguf_metadata(md).unwrap();
    for case in &golden.encode {
        let ids = tok
            .encode(case.text.as_str(), true)
            .unwrap()
            .get_ids()
            .to_vec();
        assert_eq!(ids, case.ids, "{name}: ids of {:?}", case.text);
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case.decoded,
            "{name}: decode of {:?}",
            case.text
        );
    }
    let source = md["tokenizer.chat_template"].to_string().unwrap();
    let template = ChatTemplate::new(
        source,
        special.bos_text.as_deref(),
        special.eos_text.as_deref(),
    )
    .unwrap();
    for case in &golden.chat {
        assert_eq!(
            template.render(&case.messages, true).unwrap(),
            case.rendered,
            "{name}: chat rendering"
        );
    }
}

#[test]
fn qwen2_gguf_tokenizer_and_template_match_transformers() {
    check(QWEN_05B);
}

#[test]
fn smollm2_gguf_tokenizer_and_template_match_transformers() {
    check(SMOLLM2);
}

#[test]
fn qwen_pair_shares_one_tokenizer() {
    let a = GgufFile::open(&real_model(QWEN_05B), &Device::Cpu).unwrap();
    let b = GgufFile::open(&real_model(QWEN_15B), &Device::Cpu).unwrap();
    let (ta, sa) = tokenizer::from_gguf_metadata(a.metadata()).unwrap();
    let (tb, sb) = tokenizer::from_gguf_metadata(b.metadata()).unwrap();
    assert_eq!(sa.eos, sb.eos);
    let text = "fn main() { println!(\"héllo 🦀\"); }";
    assert_eq!(
        ta.encode(text, true).unwrap().get_ids(),
        tb.encode(text, true).unwrap().get_ids()
    );
}

#[test]
fn incremental_decoding_reassembles_split_characters() {
    let file = GgufFile::open(&real_model(QWEN_05B), &Device::Cpu).unwrap();
    let (tok, _) = tokenizer::from_gguf_metadata(file.metadata()).unwrap();
    // Emoji and CJK split into byte tokens; streaming must never emit a broken character.
    let text = "Crab 🦀 says 日本語 and ünïcödé! 🚀🚀";
    let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
    let mut dec = tokenrouter::model::IncrementalDecoder::new();
    let mut out = String::new();
    for &id in &ids {
        let piece = dec.push(&tok, id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "emitted a broken character: {piece:?}"
        );
        out.push_str(&piece);
    }
    out.push_str(&dec.flush(&tok).unwrap());
    assert_eq!(out, text);
}
