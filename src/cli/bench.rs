//! `shelfserve bench`: the CUDA backend on seeded random weights (generated on the GPU) for a
//! config file, measured in one run against the device's own ceilings: device-to-device copy
//! bandwidth and a large bf16 GEMM rate, then decode tok/s per batch and context (achieved bytes/s
//! ÷ copy bandwidth) and prefill tok/s (FLOP/s ÷ GEMM rate). Prints progress to stderr, a table
//! to stdout, and optionally JSON lines for `scripts/gpu_bench.sh`.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use super::CliError;
use crate::backend::cuda::{device_memory, CudaOptions, Precision, TpCudaBackend};
use crate::backend::{BackendError, KvGeometry, SeqStep};
use crate::config::LlamaConfig;
use crate::model::llama::LlamaSpec;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model config (HF config.json format), e.g. configs/bench/llama-8b.json.
    #[arg(long, env = "SHELFSERVE_BENCH_CONFIG")]
    pub config: PathBuf,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,128")]
    pub batches: Vec<usize>,
    /// Decode context lengths (tokens already in the KV cache).
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    pub contexts: Vec<usize>,
    /// Prefill lengths (one sequence, one chunk).
    #[arg(long, value_delimiter = ',', default_value = "2048,8192")]
    pub prefill: Vec<usize>,
    /// Timed decode steps per point (after 3 warm-up steps).
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    #[arg(long, default_value_t = 0)]
    pub cuda_device: usize,
    /// Tensor-parallel ranks: the model is split over devices `cuda_device..cuda_device + N`
    /// (NCCL; set NCCL_NVLS_ENABLE=0).
    #[arg(long = "tensor-parallel-size", visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// How decode steps pick their tokens, each measured in turn: `greedy` (argmax on the
    /// device), `device` or `host` (temperature 0.8, top-p 0.9 sampled on the device, or the
    /// logits copied to the host and sampled there).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "greedy")]
    pub sampling: Vec<BenchSampling>,
    /// Append one JSON object per measurement to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchSampling {
    Greedy,
    Device,
    Host,
}

/// One decode step's tokens for `batch`, picked as `mode` says (`step` is the draw counter).
fn decode_tokens(
    b: &mut TpCudaBackend,
    batch: &[SeqStep<'_>],
    mode: BenchSampling,
    params: &crate::sampling::SamplingParams,
    step: u64,
) -> Result<Vec<u32>, BackendError> {
    use crate::backend::{Backend as _, DeviceSampleSpec};
    match mode {
        BenchSampling::Greedy => b.forward_greedy(batch),
        BenchSampling::Device => {
            let specs = vec![Some(DeviceSampleSpec { params, penalties: None, step }); batch.len()];
            let drawn = b.forward_sampled(batch, &specs)?.ok_or_else(|| {
                BackendError::InvalidStep("device sampling is off (SHELFSERVE_CUDA_SAMPLING=0)".into())
            })?;
            Ok(drawn.into_iter().map(|s| s.map_or(0, |s| s.token)).collect())
        }
        BenchSampling::Host => {
            let logits = b.forward(batch)?;
            let none = crate::sampling::PenaltyState::default();
            Ok((0..batch.len())
                .map(|i| logits.last_row(i).map_or(0, |r| crate::sampling::sample(r, params, &none, step).token))
                .collect())
        }
    }
}

pub(super) struct Report {
    json: Option<std::fs::File>,
}

impl Report {
    pub(super) fn new(path: Option<&PathBuf>) -> Result<Self, CliError> {
        Ok(Report { json: path.map(std::fs::File::create).transpose()? })
    }

    pub(super) fn emit(&mut self, v: serde_json::Value) -> Result<(), CliError> {
        if let Some(f) = &mut self.json {
            writeln!(f, "{v}")?;
        }
        Ok(())
    }
}

/// The bench config's optional `quantization` field: `fp8` (128×128 blocks), `int4` (group
/// 128) or `nvfp4`; the projections are then random packed weights made on the device.
pub(super) fn bench_quantization(text: &str) -> Result<Option<crate::model::quant::packed::PackedFormat>, String> {
    use crate::model::quant::packed::PackedFormat;
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    match v.get("quantization").filter(|q| !q.is_null()) {
        None => Ok(None),
        Some(q) => match q.as_str() {
            Some("fp8") => Ok(Some(PackedFormat::Fp8Block)),
            Some("int4") => Ok(Some(PackedFormat::Int4 { group: 128 })),
            Some("nvfp4") => Ok(Some(PackedFormat::Nvfp4)),
            _ => Err(format!("bench config: quantization {q} (expected \"fp8\", \"int4\" or \"nvfp4\")")),
        },
    }
}

fn device(e: BackendError) -> CliError {
    CliError::Usage(format!("bench: {e}"))
}

/// Median of `reps` timings of `f` (seconds), after one untimed run.
fn median_secs(reps: usize, mut f: impl FnMut() -> Result<(), BackendError>) -> Result<f64, BackendError> {
    f()?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let s = Instant::now();
        f()?;
        t.push(s.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t[t.len() / 2])
}

pub fn run_bench(args: &BenchArgs) -> Result<(), CliError> {
    let text = std::fs::read_to_string(&args.config)?;
    let model_type = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v.get("model_type").and_then(|m| m.as_str().map(str::to_string)));
    if model_type.as_deref() == Some("glm5_next") {
        let cfg = crate::model::glm5_next::Glm5Config::from_hf_json(&text, &args.config)?;
        return super::bench_glm5::run_glm5_bench(args, cfg);
    }
    let cfg = LlamaConfig::from_hf_json(&text, &args.config)?;
    let spec = LlamaSpec::new(&cfg);
    let world = args.tensor_parallel_size.max(1);
    let format = bench_quantization(&text).map_err(|e| device(BackendError::InvalidStep(e)))?;
    if format.is_some() && world > 1 {
        return Err(device(BackendError::InvalidStep("a `quantization` bench runs on one device".into())));
    }
    let weight_bytes = spec.decode_weight_elems() * 2;
    let kv_token_bytes = cfg.num_hidden_layers * 2 * cfg.kv_dim() * 2;
    // Per device: its share of the weights (plus the whole embedding and the seeded whole tensor
    // a rank cuts its share from) and of every token's KV.
    let (device_weights, device_kv_token) = (weight_bytes / world, kv_token_bytes / world);
    let (free, total) = device_memory(args.cuda_device).map_err(device)?;
    // Everything but the weights and ~8 GiB of scratch (prefill activations, logits) is KV; a
    // group leaves 4 GiB more, as NCCL allocates its channel buffers at the first collective.
    let nccl_headroom = if world > 1 { 4usize << 30 } else { 0 };
    let kv_budget =
        free.saturating_sub(device_weights + (cfg.vocab_size + cfg.hidden_size) * 4 + (8 << 30) + nccl_headroom);
    let block_bytes = device_kv_token * args.block_size;
    let geom = KvGeometry { block_size: args.block_size, num_blocks: (kv_budget / block_bytes).max(1), state_slots: 0 };
    eprintln!(
        "bench: {} ({} layers, hidden {}), tensor parallel {world}: weights {:.2} GB, KV {:.0} KiB/token; device {:.0}/{:.0} GiB free; KV store {} tokens",
        args.config.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        weight_bytes as f64 / 1e9,
        kv_token_bytes as f64 / 1024.0,
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64,
        geom.capacity_tokens()
    );
    let started = Instant::now();
    let opts = CudaOptions { ordinal: args.cuda_device, kv: geom, precision: Precision::Bf16 };
    let mut b = match format {
        Some(f) => TpCudaBackend::synthetic_packed(&cfg, 1234, opts, f),
        None => TpCudaBackend::synthetic(&cfg, 1234, opts, world),
    }
    .map_err(device)?;
    // Packed projections: a decode step reads what is held but the embedding (untied) — codes
    // and scales as stored, the head and norms — not the dense estimate above.
    let device_weights = match format {
        Some(f) => {
            let embed = if cfg.tie_word_embeddings { 0 } else { cfg.vocab_size * cfg.hidden_size * 2 };
            let held = b.weight_bytes() - embed;
            eprintln!("bench: projections packed as {}: decode reads {:.2} GB", f.name(), held as f64 / 1e9);
            held
        }
        None => device_weights,
    };
    b.fill_kv_random(99).map_err(device)?;
    let gpu_name = b.lead().gpu_name().to_string();
    eprintln!("bench: weights generated on {world} x {gpu_name} in {:.1}s", started.elapsed().as_secs_f64());
    let mut report = Report::new(args.json.as_ref())?;
    let name = args.config.file_stem().map_or("model".into(), |s| s.to_string_lossy().to_string());
    let name = if world > 1 { format!("{name}/tp{world}") } else { name };

    eprintln!("bench: measuring ceilings (2 GiB copy, 8192³ bf16 GEMM)");
    let (copy_bw, gemm_rate) = b.lead().measure_ceilings(2 << 30, 8192, 10).map_err(device)?;
    println!(
        "device {gpu_name} x {world}   copy bandwidth {:.0} GB/s   bf16 GEMM {:.0} TFLOP/s (one device)",
        copy_bw / 1e9,
        gemm_rate / 1e12
    );
    report.emit(serde_json::json!({"kind": "ceiling", "copy_bytes_per_s": copy_bw, "gemm_flops": gemm_rate, "gpu": gpu_name, "tp": world}))?;

    if world > 1 {
        println!("{:<10} {:>8} {:>14} {:>14}", "collective", "KiB", "all-reduce µs", "all-gather µs");
        for kib in [8usize, 16, 32, 64] {
            if let Some((reduce, gather)) = b.time_collectives(kib << 10, 200).map_err(device)? {
                println!("{:<10} {:>8} {:>14.1} {:>14.1}", name, kib, reduce * 1e6, gather * 1e6);
                report.emit(serde_json::json!({"kind": "collective", "tp": world, "bytes_per_rank": kib << 10,
                    "all_reduce_secs": reduce, "all_gather_secs": gather}))?;
            }
        }
    }

    println!(
        "{:<10} {:>6} {:>6} {:>7} {:>10} {:>10} {:>10} {:>8}",
        "decode", "batch", "ctx", "tokens", "ms/step", "tok/s", "GB/s", "÷copy"
    );
    let vocab = cfg.vocab_size as u32;
    let sample_params = crate::sampling::SamplingParams { temperature: 0.8, top_p: 0.9, seed: 7, ..Default::default() };
    if args.sampling.iter().any(|&m| m != BenchSampling::Greedy) {
        println!("sampled decode: temperature 0.8, top-p 0.9 (device: on the GPU; host: logits copied, host sampler)");
    }
    for &ctx in &args.contexts {
        for (&batch, &mode) in args.batches.iter().flat_map(|b| args.sampling.iter().map(move |m| (b, m))) {
            let per_seq = (ctx + args.steps + 4).div_ceil(args.block_size);
            if per_seq * batch > geom.num_blocks {
                println!("{:<10} {:>6} {:>6} {:>10}", name, batch, ctx, "KV does not fit");
                report.emit(
                    serde_json::json!({"kind": "decode", "batch": batch, "ctx": ctx, "skipped": "kv does not fit"}),
                )?;
                continue;
            }
            let tables: Vec<Vec<u32>> =
                (0..batch).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
            let mut pos = ctx;
            let mut ids: Vec<u32> = (0..batch as u32).map(|i| (i * 7919 + 11) % vocab).collect();
            let step = |b: &mut TpCudaBackend, pos: usize, ids: &mut Vec<u32>| -> Result<(), BackendError> {
                let draw = pos as u64;
                let batch_steps: Vec<SeqStep<'_>> = ids
                    .iter()
                    .zip(&tables)
                    .map(|(id, t)| SeqStep {
                        tokens: std::slice::from_ref(id),
                        start_pos: pos,
                        block_table: t,
                        logits_rows: 1,
                        state_slot: 0,
                    })
                    .collect();
                let next = decode_tokens(b, &batch_steps, mode, &sample_params, draw)?;
                *ids = next;
                Ok(())
            };
            for _ in 0..3 {
                step(&mut b, pos, &mut ids).map_err(device)?;
                pos += 1;
            }
            // Positions move forward as in real decoding: the context grows by one per step.
            let t0 = Instant::now();
            for _ in 0..args.steps {
                step(&mut b, pos, &mut ids).map_err(device)?;
                pos += 1;
            }
            let secs = t0.elapsed().as_secs_f64() / args.steps as f64;
            let mean_ctx = ctx + 3 + args.steps / 2;
            // Bytes per device (each reads its share), against one device's copy bandwidth.
            let bytes = device_weights as f64 + (batch * mean_ctx * device_kv_token) as f64;
            let bw = bytes / secs;
            println!(
                "{:<10} {:>6} {:>6} {:>7} {:>10.2} {:>10.0} {:>10.0} {:>7.0}%",
                name,
                batch,
                ctx,
                format!("{mode:?}").to_lowercase(),
                secs * 1e3,
                batch as f64 / secs,
                bw / 1e9,
                100.0 * bw / copy_bw
            );
            report.emit(
                serde_json::json!({"kind": "decode", "tp": world, "batch": batch, "ctx": ctx, "secs_per_step": secs,
                "sampling": format!("{mode:?}").to_lowercase(),
                "tok_per_s": batch as f64 / secs, "bytes_per_s": bw, "of_copy": bw / copy_bw}),
            )?;
        }
    }

    println!("{:<10} {:>6} {:>10} {:>10} {:>10} {:>8}", "prefill", "tokens", "ms", "tok/s", "TFLOP/s", "÷GEMM");
    for &n in &args.prefill {
        let blocks = n.div_ceil(args.block_size);
        if blocks > geom.num_blocks {
            println!("{:<10} {:>6} {:>10}", name, n, "KV does not fit");
            continue;
        }
        let table: Vec<u32> = (0..blocks as u32).collect();
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 31 + 7) % vocab).collect();
        let secs = median_secs(3, || {
            b.forward_greedy(&[SeqStep {
                tokens: &ids,
                start_pos: 0,
                block_table: &table,
                logits_rows: 1,
                state_slot: 0,
            }])
            .map(|_| ())
        })
        .map_err(device)?;
        let attn_flops = 4.0 * (n as f64) * (n as f64 + 1.0) / 2.0 * cfg.q_dim() as f64 * cfg.num_hidden_layers as f64;
        let flops = 2.0 * (spec.decode_weight_elems() - cfg.vocab_size * cfg.hidden_size) as f64 * n as f64
            + 2.0 * (cfg.vocab_size * cfg.hidden_size) as f64
            + attn_flops;
        println!(
            "{:<10} {:>6} {:>10.1} {:>10.0} {:>10.0} {:>7.0}%",
            name,
            n,
            secs * 1e3,
            n as f64 / secs,
            flops / secs / 1e12,
            100.0 * flops / secs / gemm_rate
        );
        report.emit(
            serde_json::json!({"kind": "prefill", "tp": world, "tokens": n, "secs": secs, "tok_per_s": n as f64 / secs,
            "flops_per_s": flops / secs, "of_gemm": flops / secs / gemm_rate}),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::quant::packed::PackedFormat;

    #[test]
    fn bench_configs_name_their_quantization() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/bench");
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(bench_quantization(&read("llama-8b.json")), Ok(None));
        assert_eq!(bench_quantization(&read("llama-8b-fp8.json")), Ok(Some(PackedFormat::Fp8Block)));
        assert_eq!(bench_quantization(&read("llama-8b-int4.json")), Ok(Some(PackedFormat::Int4 { group: 128 })));
        assert_eq!(bench_quantization(&read("llama-8b-nvfp4.json")), Ok(Some(PackedFormat::Nvfp4)));
        for f in ["llama-8b-fp8.json", "llama-8b-int4.json", "llama-8b-nvfp4.json"] {
            let cfg = LlamaConfig::from_hf_json(&read(f), &dir.join(f)).unwrap();
            assert_eq!(cfg.hidden_size, 4096, "{f}");
        }
        assert_eq!(bench_quantization(&read("glm5-next-flash.json")), Ok(None));
        assert_eq!(bench_quantization(&read("glm5-next-flash-fp8.json")), Ok(Some(PackedFormat::Fp8Block)));
        let glm5 = |f: &str| crate::model::glm5_next::Glm5Config::from_hf_json(&read(f), &dir.join(f)).unwrap();
        assert_eq!(glm5("glm5-next-flash-fp8.json").num_hidden_layers, glm5("glm5-next-flash.json").num_hidden_layers);
        let e = bench_quantization(r#"{"quantization": "q4_k"}"#).unwrap_err();
        assert!(e.contains("q4_k") && e.contains("nvfp4"), "{e}");
    }
}
