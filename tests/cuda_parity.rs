//! The CUDA backend against the CPU backend on tiny random models of every architecture and
//! every stored format: prefill of three prompts together (95 rows: the tensor-core GEMM
//! path), then decode steps of the three (the matrix-vector kernel), and each sequence alone
//! (70 rows: the GEMM; 20: the matrix-vector kernel in chunks; 5: in one call). Both sides
//! follow the CPU's greedy tokens, so every step compares logits at the same context. Decode
//! steps replay CUDA graphs (recorded at the second step of a batch size), and run launch by
//! launch once more. The K-quant cases (head size 64) run the q/k/v post-processing in one
//! kernel, the others (16) op by op. Runs on a GPU (`scripts/gpu-check.sh`), or on the CPU
//! through the emulated driver of `tests/cuda_emu` (`scripts/test.sh`; its README says how).

use candle_core::quantized::GgmlDType;
use candle_core::DType;
use tokenrouter::model::sampler::argmax;
use tokenrouter::model::tiny::{write_gguf, write_hf_dir, TinySpec};
use tokenrouter::model::{
    Architecture, ComputeTarget, KvDtype, LoadedModel, MatmulBackend, Model, SeqInput,
};
use tokenrouter::scheduler::{BlockPool, Blocks};

/// Logits agree within this fraction of the CPU's largest logit magnitude. The CPU multiplies
/// quantized weights by activations quantized to 8 bits, the GPU by `f32` activations
/// (matrix-vector) or `f16` ones (GEMM); both keep K/V in `f16`.
const RELATIVE_TOLERANCE: f32 = 0.03;
const DECODE_STEPS: usize = 6;

/// Per step, per sequence: the logits of its last position.
type Steps = Vec<Vec<Vec<f32>>>;

/// Prefills `prompts` together, then decodes them together for [`DECODE_STEPS`] steps,
/// feeding `feed[s][i]` at step `i + 1` where given, else the model's own greedy token.
fn run(
    model: &Model,
    prompts: &[Vec<u32>],
    feed: Option<&[Vec<u32>]>,
) -> Result<(Steps, Vec<Vec<u32>>), String> {
    let capacity = prompts.len() * 128;
    let mut kv = model.kv_cache_for(16, capacity, KvDtype::F16).unwrap();
    let pool = BlockPool::new(kv.num_blocks());
    let mut tables: Vec<Blocks> = prompts.iter().map(|_| Blocks::default()).collect();
    for (table, p) in tables.iter_mut().zip(prompts) {
        pool.grow(table, (p.len() + DECODE_STEPS).div_ceil(16))
            .unwrap();
    }
    let mut steps = Vec::new();
    let mut tokens: Vec<Vec<u32>> = prompts.iter().map(|_| Vec::new()).collect();
    for step in 0..=DECODE_STEPS {
        let inputs: Vec<SeqInput> = prompts
            .iter()
            .enumerate()
            .map(|(s, p)| match step {
                0 => SeqInput {
                    tokens: p,
                    start_pos: 0,
                    blocks: tables[s].ids(),
                    logits: 1,
                },
                _ => SeqInput {
                    tokens: std::slice::from_ref(&tokens[s][step - 1]),
                    start_pos: p.len() + step - 1,
                    blocks: tables[s].ids(),
                    logits: 1,
                },
            })
            .collect();
        let out = model
            .forward(&inputs, &mut kv, false)
            .map_err(|e| format!("step {step}: {e}"))?;
        let rows = out.logits.to_vec2::<f32>().map_err(|e| e.to_string())?;
        drop(inputs);
        for (s, row) in rows.iter().enumerate() {
            let next = match feed {
                Some(f) => f[s].get(step).copied().unwrap_or(0),
                None => argmax(row),
            };
            tokens[s].push(next);
        }
        steps.push(rows);
    }
    Ok((steps, tokens))
}

/// Checks `gpu` against `cpu` step by step; `what` names the case. Returns the first
/// disagreement.
fn compare(cpu: &Steps, gpu: &Steps, what: &str) -> Result<(), String> {
    for (step, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        for (s, (c, g)) in c.iter().zip(g).enumerate() {
            let scale = c.iter().fold(0f32, |m, x| m.max(x.abs()));
            let tol = RELATIVE_TOLERANCE * scale + 1e-3;
            if let Some(i) = g.iter().position(|x| !x.is_finite()) {
                return Err(format!(
                    "{what}: step {step} sequence {s}: logit {i} is {} on the GPU",
                    g[i]
                ));
            }
            let diff = c.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            if diff > tol {
                return Err(format!(
                    "{what}: step {step} sequence {s}: logits differ by {diff} (tolerance {tol})"
                ));
            }
            let mut sorted = c.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 2.0 * tol && argmax(c) != argmax(g) {
                return Err(format!(
                    "{what}: step {step} sequence {s}: greedy token {} on the GPU, {} on the CPU",
                    argmax(g),
                    argmax(c)
                ));
            }
        }
    }
    Ok(())
}

/// Every disagreement of one model file's case, so one run on a GPU reports all of them.
fn check(dir: &std::path::Path, what: &str) -> Vec<String> {
    use_kernel_cache();
    let cpu = LoadedModel::load_on(dir, ComputeTarget::Cpu(MatmulBackend::Native)).unwrap();
    let gpu = match LoadedModel::load_on(dir, ComputeTarget::Cuda(0)) {
        Ok(gpu) => gpu,
        Err(e) => return vec![format!("{what}: loading on the GPU: {e}")],
    };
    let prompts = vec![
        (1..=70).map(|i| (i * 7 % 250) as u32).collect::<Vec<u32>>(),
        vec![3, 1, 4, 1, 5],
        (1..=20).map(|i| (i * 13 % 250) as u32).collect(),
    ];
    let (cpu_steps, cpu_tokens) = run(&cpu.model, &prompts, None).unwrap();
    let mut failures: Vec<String> = run(&gpu.model, &prompts, Some(&cpu_tokens))
        .map_err(|e| format!("{what}, batched: {e}"))
        .and_then(|(gpu_steps, _)| compare(&cpu_steps, &gpu_steps, &format!("{what}, batched")))
        .err()
        .into_iter()
        .collect();
    // The decode steps above replay CUDA graphs from the third on; launch by launch too.
    let replays = gpu.model.cuda_graph_replays();
    if replays != DECODE_STEPS as u64 - 1 {
        failures.push(format!(
            "{what}, batched: {replays} of {DECODE_STEPS} decode steps replayed a CUDA graph, \
             not all but the first"
        ));
    }
    gpu.model.set_cuda_graphs(false);
    failures.extend(
        run(&gpu.model, &prompts, Some(&cpu_tokens))
            .map_err(|e| format!("{what}, batched, eager: {e}"))
            .and_then(|(steps, _)| compare(&cpu_steps, &steps, &format!("{what}, batched, eager")))
            .err(),
    );
    if gpu.model.cuda_graph_replays() != replays {
        failures.push(format!(
            "{what}, batched, eager: a decode step replayed a CUDA graph"
        ));
    }
    gpu.model.set_cuda_graphs(true);
    for (s, prompt) in prompts.iter().enumerate() {
        let one = std::slice::from_ref(prompt);
        let feed = std::slice::from_ref(&cpu_tokens[s]);
        let cpu_alone: Steps = cpu_steps.iter().map(|rows| vec![rows[s].clone()]).collect();
        let alone = format!("{what}, sequence {s} alone");
        failures.extend(
            run(&gpu.model, one, Some(feed))
                .map_err(|e| format!("{alone}: {e}"))
                .and_then(|(steps, _)| compare(&cpu_alone, &steps, &alone))
                .err(),
        );
    }
    failures
}

/// [`check`], printing the case's verdict and time as it ends.
fn timed(dir: &std::path::Path, what: &str) -> Vec<String> {
    let started = std::time::Instant::now();
    let failures = check(dir, what);
    let verdict = if failures.is_empty() { "ok" } else { "FAILED" };
    eprintln!(
        "{what}: {verdict} ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    failures
}

/// Each model opens the device, which compiles every kernel file unless it finds it cached:
/// compiled once for all of them, and kept for the next run (keyed by source and NVRTC).
fn use_kernel_cache() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernel-cache");
    tokenrouter::kernels::cuda::set_cache_dir(dir);
}

#[test]
fn gpu_logits_and_greedy_tokens_match_the_cpu() {
    use GgmlDType::*;
    let tmp = tempfile::tempdir().unwrap();
    let mut cases = 0;
    let mut failures = Vec::new();
    for arch in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
    ] {
        for (dtype, spec) in [
            (F32, TinySpec::new(arch)),
            (F16, TinySpec::new(arch)),
            (Q4_0, TinySpec::new(arch)),
            (Q4_1, TinySpec::new(arch)),
            (Q5_0, TinySpec::new(arch)),
            (Q8_0, TinySpec::new(arch)),
            (Q4K, TinySpec::new(arch).k_quant_sized()),
            (Q6K, TinySpec::new(arch).k_quant_sized()),
        ] {
            let path = tmp.path().join(format!("{arch:?}-{dtype:?}.gguf"));
            write_gguf(&spec, &path, &[dtype]).unwrap();
            failures.extend(timed(&path, &format!("{arch:?} {dtype:?}")));
            cases += 1;
        }
        for dtype in [DType::BF16, DType::F16] {
            let dir = tmp.path().join(format!("{arch:?}-{dtype:?}-hf"));
            write_hf_dir(&TinySpec::new(arch), &dir, dtype).unwrap();
            failures.extend(timed(&dir, &format!("{arch:?} safetensors {dtype:?}")));
            cases += 1;
        }
    }
    assert_eq!(cases, 30);
    assert!(
        failures.is_empty(),
        "{} of the GPU's cases disagree with the CPU:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn a_cpu_cache_is_refused_by_a_gpu_model() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    write_gguf(
        &TinySpec::new(Architecture::Qwen3),
        &path,
        &[GgmlDType::Q8_0],
    )
    .unwrap();
    use_kernel_cache();
    let gpu = LoadedModel::load_on(&path, ComputeTarget::Cuda(0)).unwrap();
    let mut kv =
        tokenrouter::model::KvCache::with_capacity(gpu.model.config(), 16, 64, KvDtype::F16)
            .unwrap();
    let mut table = Blocks::default();
    BlockPool::new(kv.num_blocks()).grow(&mut table, 1).unwrap();
    let input = SeqInput {
        tokens: &[1, 2],
        start_pos: 0,
        blocks: table.ids(),
        logits: 1,
    };
    let Err(err) = gpu.model.forward(&[input], &mut kv, false) else {
        panic!("a GPU model ran over a host-memory KV cache");
    };
    assert!(err.to_string().contains("host memory"), "{err}");
}
