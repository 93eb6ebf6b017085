//! `shelfserve bench` for a `glm5_next` config (issue 16, item 4): the CUDA backend on seeded
//! random weights generated on the GPU, measured against the device's own ceilings in one run.
//! Decode ÷ copy bandwidth counts the bytes a step really reads: every non-expert weight, the
//! distinct routed experts the step touched (counted by a profiled step at the same point), one
//! embedding row per sequence, and per sequence the cache records and KDA state the accounting
//! (`model::glm5_next::accounting`) says a token reads (f32 records and states, as stored).
//! Prefill ÷ the bf16 GEMM rate counts the FLOPs of the same accounting. A profiled step per
//! point gives the time per layer type, extrapolated to the full 45-layer model.

use std::time::Instant;

use super::bench::BenchArgs;
use super::CliError;
use crate::backend::cuda::glm5_next::{Glm5CudaBackend, StepProfile};
use crate::backend::cuda::{device_memory, Precision};
use crate::backend::{Backend, BackendError, DeviceSampleSpec, KvGeometry, SeqStep};
use crate::model::glm5_next::accounting::decode_cost;
use crate::model::glm5_next::cache_layout::CacheLayout;
use crate::model::glm5_next::config::{FfnKind, MixerKind};
use crate::model::glm5_next::layout::text_tensors;
use crate::model::glm5_next::Glm5Config;
use crate::model::quant::packed::PackedFormat;

/// glm5_next's family block size (tokens per KV block).
const BLOCK: usize = 64;
/// Bytes of device memory left for step scratch (prefill activations, grouped-MoE buffers, logits).
const SCRATCH: usize = 12 << 30;

fn device(e: BackendError) -> CliError {
    CliError::Usage(format!("bench: {e}"))
}

/// Device bytes of the synthetic weights: bf16 (f32 for the router and mHC maps and every
/// vector) or, with `format`, packed projections at their codes plus an f32 scale per
/// group (an upper bound: FP8's scales are per 128×128 block), so that a packed model is not
/// refused for a cache that only its bf16 twin would crowd out.
fn budget_bytes(c: &Glm5Config, format: Option<PackedFormat>) -> usize {
    text_tensors(c)
        .iter()
        .map(|(name, shape, _)| {
            let n: usize = shape.iter().product();
            let f32_island = shape.len() < 2 || name.ends_with("mlp.gate.weight") || name.contains("hc_");
            let kept_dense = name.contains("embed_tokens") || name.contains("lm_head") || name.contains("kv_b_proj");
            match format {
                Some(f) if !f32_island && !kept_dense && shape.len() == 2 => {
                    let (rows, cols) = (shape[0], shape[1]);
                    rows * f.code_bytes(cols) + rows * cols.div_ceil(f.group()) * 4
                }
                _ => n * if f32_island { 4 } else { 2 },
            }
        })
        .sum()
}

/// Time per layer type of one profiled step, per layer, and the full model's step from them.
struct LayerTimes {
    kda: f64,
    dsa: f64,
    dense_ffn: f64,
    moe_ffn: f64,
    rest: f64,
}

impl LayerTimes {
    fn from_profile(c: &Glm5Config, p: &StepProfile) -> Self {
        let steps = p.steps.max(1) as f64;
        let mean = |v: Vec<f64>| if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 / steps };
        let pick = |secs: &[f64], keep: &dyn Fn(usize) -> bool| -> Vec<f64> {
            (0..c.num_hidden_layers).filter(|&l| keep(l)).map(|l| secs[l]).collect()
        };
        LayerTimes {
            kda: mean(pick(&p.mixer_secs, &|l| c.layer_types[l] == MixerKind::Kda)),
            dsa: mean(pick(&p.mixer_secs, &|l| c.layer_types[l] == MixerKind::Dsa)),
            dense_ffn: mean(pick(&p.ffn_secs, &|l| c.mlp_layer_types[l] == FfnKind::Dense)),
            moe_ffn: mean(pick(&p.ffn_secs, &|l| c.mlp_layer_types[l] == FfnKind::Moe)),
            rest: p.rest_secs / steps,
        }
    }

    /// The report's `layer_secs` object.
    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({"kda_mixer": self.kda, "dsa_mixer": self.dsa, "moe_ffn": self.moe_ffn,
            "dense_ffn": self.dense_ffn, "rest": self.rest})
    }

    /// One step of `full` from these per-layer times.
    fn extrapolate(&self, full: &Glm5Config) -> f64 {
        let mut t = self.rest;
        for l in 0..full.num_hidden_layers {
            t += match full.layer_types[l] {
                MixerKind::Kda => self.kda,
                MixerKind::Dsa => self.dsa,
            };
            t += match full.mlp_layer_types[l] {
                FfnKind::Dense => self.dense_ffn,
                FfnKind::Moe => self.moe_ffn,
            };
        }
        t
    }
}

/// Bytes one decode step of `batch` sequences at `ctx` reads with `distinct` experts touched in
/// all: weights (all but the routed experts and the embedding), the touched experts, one
/// embedding row per sequence, and each sequence's cache and recurrent-state traffic.
fn step_bytes(c: &Glm5Config, weights: usize, expert_bytes: usize, distinct: usize, batch: usize, ctx: usize) -> f64 {
    let moe_layers = c.mlp_layer_types.iter().filter(|&&f| f == FfnKind::Moe).count();
    let embed = c.vocab_size * c.hidden_size * 2;
    let fixed = weights - moe_layers * c.n_routed_experts * expert_bytes - embed + batch * c.hidden_size * 2;
    let per_seq = decode_cost(c, ctx, 2.0, 4);
    (fixed + distinct * expert_bytes) as f64
        + batch as f64 * (per_seq.cache_read_bytes + per_seq.recurrent_traffic_bytes) as f64
}

pub fn run_glm5_bench(args: &BenchArgs, cfg: Glm5Config) -> Result<(), CliError> {
    if args.tensor_parallel_size > 1 {
        return Err(CliError::Usage("bench: glm5_next runs on one GPU (no --tensor-parallel-size yet)".into()));
    }
    let full = Glm5Config::from_hf_json(r#"{"model_type": "glm5_next"}"#, std::path::Path::new("<defaults>"))?;
    let text = std::fs::read_to_string(&args.config)?;
    let format = super::bench::bench_quantization(&text).map_err(|e| device(BackendError::InvalidStep(e)))?;
    // The step's bytes count what was made; this is the budget before making it.
    let weights = budget_bytes(&cfg, format);
    let layout = CacheLayout::new(&cfg);
    let (free, total) = device_memory(args.cuda_device).map_err(device)?;
    let max_batch = args.batches.iter().copied().max().unwrap_or(1);
    let slot_bytes = 4 * layout.slot_stride;
    // A model without MLA layers keeps no per-token cache: one block stands for it.
    let block_bytes = (4 * layout.token_stride * BLOCK).max(1);
    let kv_budget = free.saturating_sub(weights + SCRATCH + max_batch * slot_bytes);
    // No more cache than the largest point needs: the rest stays free for the steps' scratch.
    let needed = args
        .contexts
        .iter()
        .flat_map(|&ctx| args.batches.iter().map(move |&b| b * (ctx + args.steps + 8).div_ceil(BLOCK)))
        .chain(args.prefill.iter().map(|&n| n.div_ceil(BLOCK)))
        .max()
        .unwrap_or(1);
    let num_blocks = (kv_budget / block_bytes).clamp(1, needed.max(1));
    let geom = KvGeometry { block_size: BLOCK, num_blocks, state_slots: max_batch };
    eprintln!(
        "bench: {} ({} layers: {} KDA, {} MLA/DSA; {} MoE of {} experts top-{}), weights {:.1} GB; device {:.0}/{:.0} GiB free; cache {} tokens ({} B/token f32), {} state slots of {:.1} MB",
        args.config.display(),
        cfg.num_hidden_layers,
        cfg.layer_types.iter().filter(|&&k| k == MixerKind::Kda).count(),
        cfg.layer_types.iter().filter(|&&k| k == MixerKind::Dsa).count(),
        cfg.mlp_layer_types.iter().filter(|&&f| f == FfnKind::Moe).count(),
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        weights as f64 / 1e9,
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64,
        geom.capacity_tokens(),
        4 * layout.token_stride,
        max_batch,
        slot_bytes as f64 / 1e6
    );
    let started = Instant::now();
    let mut b = Glm5CudaBackend::synthetic(cfg.clone(), 1234, args.cuda_device, geom, Precision::Bf16, format)
        .map_err(device)?;
    let gpu_name = b.gpu_name().to_string();
    let weights = b.weight_bytes();
    eprintln!(
        "bench: weights generated on {gpu_name} in {:.1}s: {:.1} GB ({})",
        started.elapsed().as_secs_f64(),
        weights as f64 / 1e9,
        format.map_or("bf16".to_string(), |f| format!("projections {}, embedding and LM head bf16", f.name()))
    );
    eprintln!("bench: measuring ceilings (1 GiB copy, 8192³ bf16 GEMM)");
    let (copy_bw, gemm_rate) = b.measure_ceilings(1 << 30, 8192, 10).map_err(device)?;
    let mut report = super::bench::Report::new(args.json.as_ref())?;
    let name = args.config.file_stem().map_or("glm5".into(), |s| s.to_string_lossy().to_string());
    println!(
        "device {gpu_name}   copy bandwidth {:.0} GB/s   bf16 GEMM {:.0} TFLOP/s",
        copy_bw / 1e9,
        gemm_rate / 1e12
    );
    report.emit(serde_json::json!({"kind": "ceiling", "copy_bytes_per_s": copy_bw, "gemm_flops": gemm_rate, "gpu": gpu_name, "model": name}))?;
    println!(
        "{:<16} {:>6} {:>6} {:>10} {:>9} {:>9} {:>10} {:>9} {:>7} {:>9} | {:>8} {:>8} {:>8} {:>8} {:>7} {:>11} {:>10}",
        "decode",
        "batch",
        "ctx",
        "ms/step",
        "queue ms",
        "tok/s",
        "GB/step",
        "GB/s",
        "÷copy",
        "experts",
        "KDA ms",
        "DSA ms",
        "MoE ms",
        "dense ms",
        "rest ms",
        "45L ms/step",
        "45L tok/s"
    );
    let vocab = cfg.vocab_size as u32;
    let expert_bytes = b.expert_bytes();
    let moe_layers = cfg.mlp_layer_types.iter().filter(|&&f| f == FfnKind::Moe).count().max(1);
    for &ctx in &args.contexts {
        for &batch in &args.batches {
            let per_seq = (ctx + args.steps + 8).div_ceil(BLOCK);
            if per_seq * batch > geom.num_blocks {
                println!("{:<16} {:>6} {:>6} {:>10}", name, batch, ctx, "cache does not fit");
                report.emit(
                    serde_json::json!({"kind": "decode", "batch": batch, "ctx": ctx, "skipped": "cache does not fit"}),
                )?;
                continue;
            }
            b.fill_cache_random(99).map_err(device)?;
            let tables: Vec<Vec<u32>> =
                (0..batch).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
            let mut pos = ctx;
            let greedy = crate::sampling::SamplingParams { temperature: 0.0, ..Default::default() };
            let step = |b: &mut Glm5CudaBackend, pos: usize| -> Result<(), BackendError> {
                let ids: Vec<u32> = (0..batch).map(|i| ((i * 7919 + pos * 31 + 11) % vocab as usize) as u32).collect();
                let steps: Vec<SeqStep<'_>> = ids
                    .iter()
                    .zip(&tables)
                    .enumerate()
                    .map(|(s, (id, t))| SeqStep {
                        tokens: std::slice::from_ref(id),
                        start_pos: pos,
                        block_table: t,
                        logits_rows: 1,
                        state_slot: s as u32,
                    })
                    .collect();
                // Greedy on the device, as a served greedy step runs (the host path when device
                // sampling is off).
                let specs = vec![Some(DeviceSampleSpec { params: &greedy, penalties: None, step: 0 }); steps.len()];
                match b.forward_sampled(&steps, &specs)? {
                    Some(_) => Ok(()),
                    None => b.forward(&steps).map(|_| ()),
                }
            };
            for _ in 0..3 {
                step(&mut b, pos).map_err(device)?;
                pos += 1;
            }
            b.take_enqueue_secs();
            let t0 = Instant::now();
            for _ in 0..args.steps {
                step(&mut b, pos).map_err(device)?;
                pos += 1;
            }
            let secs = t0.elapsed().as_secs_f64() / args.steps as f64;
            // Host time queueing a step's launches: near `secs`, the GPU waits for the host.
            let queue_secs = b.take_enqueue_secs() / args.steps as f64;
            b.start_profile();
            step(&mut b, pos).map_err(device)?;
            let profile = b.take_profile().unwrap_or_default();
            let times = LayerTimes::from_profile(&cfg, &profile);
            let distinct: usize = profile.distinct_experts.iter().sum();
            let bytes = step_bytes(&cfg, weights, expert_bytes, distinct, batch, ctx + 3 + args.steps / 2);
            let full_secs = times.extrapolate(&full);
            let ms = |s: f64| s * 1e3;
            println!(
                "{:<16} {:>6} {:>6} {:>10.2} {:>9.2} {:>9.0} {:>10.2} {:>9.0} {:>6.0}% {:>9.1} | {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>7.3} {:>11.1} {:>10.0}",
                name,
                batch,
                ctx,
                ms(secs),
                ms(queue_secs),
                batch as f64 / secs,
                bytes / 1e9,
                bytes / secs / 1e9,
                100.0 * bytes / secs / copy_bw,
                distinct as f64 / moe_layers as f64,
                ms(times.kda),
                ms(times.dsa),
                ms(times.moe_ffn),
                ms(times.dense_ffn),
                ms(times.rest),
                ms(full_secs),
                batch as f64 / full_secs
            );
            report.emit(serde_json::json!({"kind": "decode", "batch": batch, "ctx": ctx, "secs_per_step": secs,
                "queue_secs_per_step": queue_secs, "tok_per_s": batch as f64 / secs, "bytes_per_step": bytes, "of_copy": bytes / secs / copy_bw,
                "distinct_experts_per_moe_layer": distinct as f64 / moe_layers as f64,
                "layer_secs": times.to_json(),
                "full_model_secs_per_step": full_secs, "full_model_tok_per_s": batch as f64 / full_secs}))?;
        }
    }

    println!(
        "{:<16} {:>6} {:>10} {:>10} {:>10} {:>8} | {:>8} {:>8} {:>8} {:>8} {:>7}",
        "prefill", "tokens", "ms", "tok/s", "TFLOP/s", "÷GEMM", "kda ms", "dsa ms", "moe ms", "dense ms", "rest ms"
    );
    // The decode points' buffers (split attention at long context, large batches) would stay
    // beside the prefill's own.
    b.release_scratch().map_err(device)?;
    for &n in &args.prefill {
        let blocks = n.div_ceil(BLOCK);
        if blocks > geom.num_blocks {
            println!("{:<16} {:>6} {:>10}", name, n, "cache does not fit");
            continue;
        }
        let table: Vec<u32> = (0..blocks as u32).collect();
        let ids: Vec<u32> = (0..n as u32).map(|i| (i * 31 + 7) % vocab).collect();
        let mut times = Vec::new();
        for _ in 0..3 {
            let t0 = Instant::now();
            b.forward(&[SeqStep { tokens: &ids, start_pos: 0, block_table: &table, logits_rows: 1, state_slot: 0 }])
                .map_err(device)?;
            times.push(t0.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let secs = times[1];
        // One more, profiled (synchronised after every part): where the prefill's time goes.
        b.start_profile();
        b.forward(&[SeqStep { tokens: &ids, start_pos: 0, block_table: &table, logits_rows: 1, state_slot: 0 }])
            .map_err(device)?;
        let parts = LayerTimes::from_profile(&cfg, &b.take_profile().unwrap_or_default());
        // Every token multiplies the active weights (the LM head only for the last) and attends
        // to the selection at its position; the middle position stands for the mean.
        let per_token = decode_cost(&cfg, n / 2, 2.0, 4);
        let head = 2 * (cfg.vocab_size * cfg.hidden_size) as u64;
        let flops = (per_token.total_flops() - head) as f64 * n as f64 + head as f64;
        println!(
            "{:<16} {:>6} {:>10.1} {:>10.0} {:>10.1} {:>7.1}% | {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>7.2}",
            name,
            n,
            secs * 1e3,
            n as f64 / secs,
            flops / secs / 1e12,
            100.0 * flops / secs / gemm_rate,
            parts.kda * 1e3,
            parts.dsa * 1e3,
            parts.moe_ffn * 1e3,
            parts.dense_ffn * 1e3,
            parts.rest * 1e3
        );
        report.emit(serde_json::json!({"kind": "prefill", "tokens": n, "secs": secs, "tok_per_s": n as f64 / secs,
            "flops_per_s": flops / secs, "of_gemm": flops / secs / gemm_rate,
            "layer_secs": parts.to_json()}))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(json: &str) -> Glm5Config {
        Glm5Config::from_hf_json(json, std::path::Path::new("<test>")).unwrap()
    }

    #[test]
    fn bench_config_keeps_the_full_widths_and_the_three_to_one_pattern() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/configs/bench/glm5-next-flash.json"))
            .unwrap();
        let c = cfg(&text);
        let full = cfg(r#"{"model_type": "glm5_next"}"#);
        assert_eq!(
            (c.hidden_size, c.n_routed_experts, c.kv_lora_rank),
            (full.hidden_size, full.n_routed_experts, full.kv_lora_rank)
        );
        assert_eq!(c.layer_types, full.layer_types[..c.num_hidden_layers]);
        assert_eq!(c.mlp_layer_types, full.mlp_layer_types[..c.num_hidden_layers]);
        // One H200 (141 GB) holds the weights with room for the cache and the step's scratch.
        let gb = budget_bytes(&c, None) as f64 / 1e9;
        assert!(gb < 120.0 && gb > 60.0, "{gb} GB");
    }

    #[test]
    fn packed_budget_counts_codes_and_scales_and_layers_without_mla_keep_no_cache() {
        let c = cfg(r#"{"model_type": "glm5_next", "num_hidden_layers": 8}"#);
        let bf16 = budget_bytes(&c, None) as f64;
        let int4 = budget_bytes(&c, Some(PackedFormat::Int4 { group: 128 })) as f64;
        let fp8 = budget_bytes(&c, Some(PackedFormat::Fp8Block)) as f64;
        // Projections at a quarter and a half of bf16 plus scales; embedding and LM head stay.
        assert!(int4 < 0.35 * bf16 && int4 > 0.25 * bf16, "{int4} of {bf16}");
        assert!(fp8 < 0.6 * bf16 && fp8 > int4, "{fp8} of {bf16}");
        // The first two layers are KDA only: no per-token cache, which the bench must not divide by.
        let two = cfg(r#"{"model_type": "glm5_next", "num_hidden_layers": 2}"#);
        assert_eq!(CacheLayout::new(&two).token_stride, 0);
    }

    #[test]
    fn step_bytes_count_touched_experts_and_each_sequence_once() {
        let c = cfg(r#"{"model_type": "glm5_next", "num_hidden_layers": 4}"#);
        let w = budget_bytes(&c, None);
        let e = 3 * c.hidden_size * c.moe_intermediate_size * 2;
        let one = step_bytes(&c, w, e, 8, 1, 1024);
        let more_experts = step_bytes(&c, w, e, 16, 1, 1024);
        assert_eq!(more_experts - one, (8 * e) as f64);
        let two = step_bytes(&c, w, e, 8, 2, 1024);
        let per_seq = decode_cost(&c, 1024, 2.0, 4);
        let expected = (c.hidden_size * 2) as f64 + (per_seq.cache_read_bytes + per_seq.recurrent_traffic_bytes) as f64;
        assert!((two - one - expected).abs() < 1.0);
        // Untouched experts are not read: far below the whole model.
        assert!(one < w as f64 / 4.0);
    }

    #[test]
    fn full_model_step_sums_each_layer_by_its_type() {
        let full = cfg(r#"{"model_type": "glm5_next"}"#);
        let t = LayerTimes { kda: 1.0, dsa: 10.0, dense_ffn: 100.0, moe_ffn: 1000.0, rest: 0.5 };
        let kda = full.layer_types.iter().filter(|&&k| k == MixerKind::Kda).count() as f64;
        let dense = full.mlp_layer_types.iter().filter(|&&f| f == FfnKind::Dense).count() as f64;
        let n = full.num_hidden_layers as f64;
        let expected = 0.5 + kda + 10.0 * (n - kda) + 100.0 * dense + 1000.0 * (n - dense);
        assert_eq!(t.extrapolate(&full), expected);
    }
}
