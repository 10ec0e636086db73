//! Tiny random checkpoints of every supported architecture and weight format against
//! candle-transformers' implementations: GGUF in each quant type (quantized_qwen2,
//! quantized_llama, quantized_qwen3) and safetensors directories in f32/f16/bf16 (qwen2).

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device};
use candle_transformers::models::qwen2;
use common::*;
use tokenrouter::model::tiny::{write_gguf, write_hf_dir, TinySpec};
use tokenrouter::model::{Architecture, KvDtype, LoadedModel};

const STEPS: usize = 10;
/// Float checkpoints: only summation order differs from the reference.
const FLOAT_TOLERANCE: f32 = 1e-3;
/// Quantized checkpoints: activations are re-quantized to 8 bits before each matmul, so a
/// last-bit difference in attention can move one activation by one quantum and a logit by
/// a few hundredths.
const QUANT_TOLERANCE: f32 = 0.1;

fn check_gguf(spec: TinySpec, types: &[GgmlDType]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(&spec, &path, types).unwrap();
    let lm = LoadedModel::load(&path, &Device::Cpu).unwrap();
    let prompt = lm
        .encode_chat(&[tokenrouter::model::ChatMessage::new(
            "user",
            "the cat and the hat",
        )])
        .unwrap();
    let float = types
        .iter()
        .all(|t| matches!(t, GgmlDType::F32 | GgmlDType::F16));
    // The cache keeps f32 like the reference's, so only the weight formats differ (random
    // tiny weights amplify f16 rounding of K and V; the real models' comparisons use the
    // default f16 cache).
    let mut ours = Ours::with_kv_dtype(&lm.model, prompt.len() + STEPS + 16, KvDtype::F32);
    let mut reference = candle_gguf_model(&path);
    let label = format!("{:?} {types:?}", spec.architecture);
    let tol = if float {
        FLOAT_TOLERANCE
    } else {
        QUANT_TOLERANCE
    };
    let cmp = compare_greedy(
        &label,
        &prompt,
        STEPS,
        tol,
        |c| ours.next_logits(c),
        |c| reference(c),
    );
    assert!(
        cmp.max_abs_diff < tol,
        "{label}: logits differ by {}",
        cmp.max_abs_diff
    );
}

#[test]
fn qwen2_gguf_in_32_wide_quant_types_matches_reference() {
    let spec = TinySpec::new(Architecture::Qwen2);
    check_gguf(
        spec,
        &[
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
        ],
    );
}

#[test]
fn qwen2_gguf_in_k_quants_matches_reference() {
    let spec = TinySpec::new(Architecture::Qwen2).k_quant_sized();
    check_gguf(
        spec,
        &[
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5K,
            GgmlDType::Q8_0,
        ],
    );
}

#[test]
fn llama_gguf_with_tied_embeddings_matches_reference() {
    let spec = TinySpec::new(Architecture::Llama);
    assert!(spec.tied_embeddings);
    check_gguf(spec, &[GgmlDType::Q8_0, GgmlDType::Q4_1]);
}

/// A tied model's embedding lookup reads the LM head's interleaved rows (the loaded matrix is
/// dropped), and they are candle's dequantization of the file's `token_embd.weight`, bit for
/// bit, in every format the interleaved kernels take.
#[test]
fn a_tied_embedding_is_looked_up_in_the_lm_heads_own_rows() {
    let llama = TinySpec::new(Architecture::Llama);
    for (spec, dtype) in [
        (llama.clone(), GgmlDType::Q8_0),
        (llama.clone(), GgmlDType::Q4_0),
        (llama.clone(), GgmlDType::Q4_1),
        (llama.clone(), GgmlDType::Q5_0),
        (llama.clone().k_quant_sized(), GgmlDType::Q4K),
        (llama.clone().k_quant_sized(), GgmlDType::Q6K),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_gguf(&spec, &path, &[dtype]).unwrap();
        let lm = LoadedModel::load(&path, &Device::Cpu).unwrap();
        assert!(lm.model.embeds_from_lm_head(), "{dtype:?}");

        let mut file = std::fs::File::open(&path).unwrap();
        let ct = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
        let table = ct
            .tensor(&mut file, "token_embd.weight", &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let h = spec.hidden_size;
        let ids: Vec<u32> = (0..spec.vocab_size() as u32).step_by(7).collect();
        let ours = lm.model.embed(&ids).unwrap();
        for (row, &id) in ours.chunks_exact(h).zip(&ids) {
            let id = id as usize;
            assert_eq!(row, &table[id * h..(id + 1) * h], "{dtype:?} token {id}");
        }
    }
}

#[test]
fn qwen3_gguf_with_qk_norm_matches_reference() {
    let spec = TinySpec::new(Architecture::Qwen3);
    check_gguf(spec, &[GgmlDType::Q8_0, GgmlDType::Q4_0]);
}

#[test]
fn float_gguf_matches_reference() {
    check_gguf(TinySpec::new(Architecture::Qwen2), &[GgmlDType::F32]);
    check_gguf(TinySpec::new(Architecture::Llama), &[GgmlDType::F16]);
}

fn check_hf_dir(dtype: DType) {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Architecture::Qwen2);
    write_hf_dir(&spec, dir.path(), dtype).unwrap();
    let lm = LoadedModel::load(dir.path(), &Device::Cpu).unwrap();

    // candle's Qwen2 config from the config.json we wrote, plus the keys only it needs.
    let text = std::fs::read_to_string(dir.path().join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    for (key, value) in [
        ("sliding_window", serde_json::json!(spec.context_length)),
        ("max_window_layers", serde_json::json!(spec.num_layers)),
        ("use_sliding_window", serde_json::json!(false)),
        ("hidden_act", serde_json::json!("silu")),
    ] {
        json[key] = value;
    }
    let cfg: qwen2::Config = serde_json::from_value(json).unwrap();
    let files = vec![dir.path().join("model.safetensors")];
    let vb = unsafe {
        candle_nn::VarBuilder::from_mmaped_safetensors(&files, DType::F32, &Device::Cpu).unwrap()
    };
    let mut m = qwen2::ModelForCausalLM::new(&cfg, vb).unwrap();
    let mut reference = Reference::new(move |x, p| m.forward(x, p));
    let prompt = lm.encode("and the cat is on the mat, and then").unwrap();
    let mut ours = Ours::new(&lm.model, prompt.len() + STEPS + 16);
    let label = format!("qwen2 safetensors {dtype:?}");
    let cmp = compare_greedy(
        &label,
        &prompt,
        STEPS,
        FLOAT_TOLERANCE,
        |c| ours.next_logits(c),
        |c| reference.next_logits(c),
    );
    assert!(
        cmp.max_abs_diff < FLOAT_TOLERANCE,
        "{label}: logits differ by {}",
        cmp.max_abs_diff
    );
}

#[test]
fn safetensors_f32_directory_matches_reference() {
    check_hf_dir(DType::F32);
}

#[test]
fn safetensors_f16_and_bf16_directories_match_reference() {
    check_hf_dir(DType::F16);
    check_hf_dir(DType::BF16);
}

#[test]
fn hf_directory_and_gguf_of_the_same_weights_agree() {
    // The same random weights through both loaders (f32 everywhere): identical logits.
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Architecture::Qwen2);
    write_hf_dir(&spec, &dir.path().join("hf"), DType::F32).unwrap();
    write_gguf(&spec, &dir.path().join("m.gguf"), &[GgmlDType::F32]).unwrap();
    let a = LoadedModel::load(&dir.path().join("hf"), &Device::Cpu).unwrap();
    let b = LoadedModel::load(&dir.path().join("m.gguf"), &Device::Cpu).unwrap();
    let prompt = a.encode("hello there").unwrap();
    assert_eq!(prompt, b.encode("hello there").unwrap());
    let la = Ours::new(&a.model, 64).next_logits(&prompt);
    let lb = Ours::new(&b.model, 64).next_logits(&prompt);
    assert_eq!(la, lb);
}

/// A sequence that does not ask for logits (a prefill chunk that does not end its prompt)
/// gets no row: the others' rows are those of the same batch where every sequence asks, in
/// batch order; its K/V are still written, so its next chunk continues from them; and a batch
/// where nobody asks returns no rows at all.
#[test]
fn sequences_get_the_logits_rows_they_ask_for() {
    use candle_core::Tensor;
    use tokenrouter::model::{KvCache, SeqInput};
    use tokenrouter::scheduler::{BlockPool, Blocks};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let spec = TinySpec::new(Architecture::Qwen2);
    write_gguf(&spec, &path, &[GgmlDType::F32]).unwrap();
    let model = LoadedModel::load(&path, &Device::Cpu).unwrap().model;
    let rows = |t: &Tensor| t.to_vec2::<f32>().unwrap();
    let close = |a: &[f32], b: &[f32]| {
        let diff = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(a.len() == b.len() && diff < 1e-4, "differ by {diff}");
    };
    let long: Vec<u32> = (1..=20).collect();
    let short = [5u32, 6, 7];
    // The first 12 tokens of `long` with or without logits, then `short` and one more token.
    let run = |chunk_logits: usize| {
        let mut kv = KvCache::with_capacity(model.config(), 16, 128, KvDtype::F32).unwrap();
        let pool = BlockPool::new(kv.num_blocks());
        let mut tables = [Blocks::default(), Blocks::default(), Blocks::default()];
        for (table, len) in tables.iter_mut().zip([long.len(), short.len(), 1]) {
            pool.grow(table, len.div_ceil(16)).unwrap();
        }
        let batch: Vec<SeqInput> = [(&long[..12], chunk_logits), (&short[..], 1), (&[9], 1)]
            .into_iter()
            .zip(&tables)
            .map(|((tokens, logits), table)| SeqInput {
                tokens,
                start_pos: 0,
                blocks: table.ids(),
                logits,
            })
            .collect();
        let out = model.forward(&batch, &mut kv, true).unwrap();
        (out, kv, tables)
    };
    let (all, ..) = run(1);
    let (some, mut kv, tables) = run(0);
    assert_eq!(all.logits.dims(), &[3, spec.vocab_size()]);
    assert_eq!(some.logits.dims(), &[2, spec.vocab_size()]);
    assert_eq!(some.hidden.as_ref().unwrap().dims(), &[2, spec.hidden_size]);
    for (got, want) in rows(&some.logits).iter().zip(&rows(&all.logits)[1..]) {
        close(got, want);
    }
    // The rest of `long` asks for the logits of all its 8 positions (as verifying drafts
    // does): each row equals the one-pass computation's at that position.
    let rest = SeqInput {
        tokens: &long[12..],
        start_pos: 12,
        blocks: tables[0].ids(),
        logits: 8,
    };
    let continued = model.forward(&[rest], &mut kv, false).unwrap();
    let whole = {
        let mut kv = KvCache::with_capacity(model.config(), 16, 128, KvDtype::F32).unwrap();
        let mut table = Blocks::default();
        BlockPool::new(kv.num_blocks())
            .grow(&mut table, long.len().div_ceil(16))
            .unwrap();
        let input = SeqInput {
            tokens: &long,
            start_pos: 0,
            blocks: table.ids(),
            logits: long.len(),
        };
        model.forward(&[input], &mut kv, false).unwrap()
    };
    assert_eq!(continued.logits.dims(), &[8, spec.vocab_size()]);
    assert_eq!(whole.logits.dims(), &[20, spec.vocab_size()]);
    for (got, want) in rows(&continued.logits)
        .iter()
        .zip(&rows(&whole.logits)[12..])
    {
        close(got, want);
    }
    let too_many = SeqInput {
        tokens: &[3],
        start_pos: 20,
        blocks: tables[0].ids(),
        logits: 2,
    };
    assert!(model.forward(&[too_many], &mut kv, false).is_err());
    let silent = SeqInput {
        tokens: &[3],
        start_pos: 20,
        blocks: tables[0].ids(),
        logits: 0,
    };
    // (Two blocks of 16 hold position 20 already.)
    let none = model.forward(&[silent], &mut kv, true).unwrap();
    assert_eq!(none.logits.dims(), &[0, spec.vocab_size()]);
    assert_eq!(none.hidden.unwrap().dims(), &[0, spec.hidden_size]);
}

#[test]
fn hidden_state_is_the_final_normed_state_the_lm_head_reads() {
    use candle_core::Tensor;
    use tokenrouter::model::runner::{step, Sequence};
    use tokenrouter::model::KvCache;
    // f32 Llama with tied embeddings: logits = hidden · embeddingᵀ exactly.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tied.gguf");
    let spec = TinySpec::new(Architecture::Llama);
    write_gguf(&spec, &path, &[GgmlDType::F32]).unwrap();
    let lm = LoadedModel::load(&path, &Device::Cpu).unwrap();
    let mut kv = KvCache::with_capacity(lm.model.config(), 16, 128, KvDtype::default()).unwrap();
    let pool = tokenrouter::scheduler::BlockPool::new(kv.num_blocks());
    let mut a = Sequence::new(vec![5, 6, 7]);
    let mut b = Sequence::new(vec![9]);
    let out = step(&lm.model, &mut kv, &pool, &mut [&mut a, &mut b], true).unwrap();
    let hidden = out.hidden.unwrap();
    assert_eq!(hidden.dims(), &[2, spec.hidden_size]);

    let mut file = std::fs::File::open(&path).unwrap();
    let ct = candle_core::quantized::gguf_file::Content::read(&mut file).unwrap();
    let embed = ct
        .tensor(&mut file, "token_embd.weight", &Device::Cpu)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap();
    let logits: Tensor = hidden.matmul(&embed.t().unwrap()).unwrap();
    let diff = (logits - &out.logits)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(diff < 1e-4, "hidden · Eᵀ differs from the logits by {diff}");
}

/// The weights a decode step streams, split by projection: each projection's matrices (and
/// q/k/v's biases) over every layer, counted here from the shapes and Q8_0's 34 bytes a
/// 32-value block.
#[test]
fn streamed_weight_bytes_split_by_projection() {
    let spec = TinySpec::new(Architecture::Qwen2);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(&spec, &path, &[GgmlDType::Q8_0]).unwrap();
    let model = LoadedModel::load(&path, &Device::Cpu).unwrap().model;
    let (h, ffn, layers) = (spec.hidden_size, spec.intermediate_size, spec.num_layers);
    let (q, kv) = (
        spec.num_heads * spec.head_dim(),
        spec.num_kv_heads * spec.head_dim(),
    );
    let q8 = |rows: usize, cols: usize| rows * cols / 32 * 34;
    // q/k/v with their f32 biases (Qwen2), o, gate and up, down.
    let per_layer = [
        q8(q + 2 * kv, h) + 4 * (q + 2 * kv),
        q8(h, q),
        2 * q8(ffn, h),
        q8(h, ffn),
    ];
    assert_eq!(model.projection_bytes(), per_layer.map(|b| layers * b));
    assert_eq!(model.lm_head_bytes(), q8(spec.vocab_size(), h));
    // Besides: two f32 norms a layer and the final one.
    let norms = (2 * layers + 1) * 4 * h;
    assert_eq!(
        model.streamed_weight_bytes(),
        layers * per_layer.iter().sum::<usize>() + model.lm_head_bytes() + norms
    );
}

/// A random-weight model takes only the tokenizer from its path: a GGUF's tensors and a
/// Hugging Face directory's weights and config are not read.
#[test]
fn random_weights_take_only_the_tokenizer_from_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Architecture::Qwen2);
    let hf = dir.path().join("hf");
    write_hf_dir(&spec, &hf, DType::F32).unwrap();
    for entry in std::fs::read_dir(&hf).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.ends_with(".safetensors") || name == "config.json" {
            std::fs::remove_file(path).unwrap();
        }
    }
    let gguf = dir.path().join("m.gguf");
    write_gguf(&spec, &gguf, &[GgmlDType::Q8_0]).unwrap();
    let target = tokenrouter::model::ComputeTarget::Cpu(Default::default());
    for path in [&hf, &gguf] {
        let lm = LoadedModel::load_random(path, "qwen2.5-0.5b:q8_0", target).unwrap();
        let config = lm.model.config();
        assert_eq!(
            (config.hidden_size, config.num_layers, config.vocab_size),
            (896, 24, 151_936),
            "{}",
            path.display()
        );
        let own = LoadedModel::load(&gguf, &Device::Cpu).unwrap();
        assert_eq!(lm.encode("hello").unwrap(), own.encode("hello").unwrap());
    }
    let err = LoadedModel::load_random(&gguf, "qwen3-8b:q2_k", target)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("q2_k"), "{err}");
}

/// A draft vocabulary: `forward` gives the first ids' logits as the whole head does and -inf
/// past them; `forward_all_positions` keeps the whole head. A GGUF file and a Hugging Face
/// directory alike.
#[test]
fn a_draft_vocabulary_keeps_the_first_logits_and_masks_the_rest() {
    use tokenrouter::model::runner::{score_text, step, Sequence};
    use tokenrouter::model::KvCache;
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec::new(Architecture::Qwen2);
    let gguf = dir.path().join("tiny.gguf");
    write_gguf(&spec, &gguf, &[GgmlDType::Q8_0]).unwrap();
    let hf = dir.path().join("hf");
    write_hf_dir(&spec, &hf, DType::F32).unwrap();
    let n = 100;
    for path in [gguf, hf] {
        let full = LoadedModel::load(&path, &Device::Cpu).unwrap();
        let mut draft = LoadedModel::load(&path, &Device::Cpu).unwrap();
        draft.set_draft_vocab(n).unwrap();
        let logits = |lm: &LoadedModel| {
            let mut kv = KvCache::with_capacity(lm.model.config(), 16, 64, KvDtype::F32).unwrap();
            let pool = tokenrouter::scheduler::BlockPool::new(kv.num_blocks());
            let mut seq = Sequence::new(vec![5, 6, 7, 8, 9]);
            let out = step(&lm.model, &mut kv, &pool, &mut [&mut seq], false).unwrap();
            out.logits.to_vec2::<f32>().unwrap().remove(0)
        };
        let (whole, some) = (logits(&full), logits(&draft));
        assert_eq!(some.len(), whole.len());
        for (t, (a, b)) in some.iter().zip(&whole).enumerate().take(n) {
            assert!(
                (a - b).abs() < 1e-4,
                "{}: token {t}: {a} against {b}",
                path.display()
            );
        }
        assert!(some[n..].iter().all(|&l| l == f32::NEG_INFINITY));
        let text = [5u32, 6, 7];
        let scored = score_text(&draft.model, &text).unwrap().logits;
        let want = score_text(&full.model, &text).unwrap().logits;
        assert_eq!(
            scored.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap()
        );
        assert!(draft.set_draft_vocab(spec.vocab_size() + 1).is_err());
    }
}
