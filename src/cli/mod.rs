//! Command-line interface: argument definitions (every flag also an environment variable) and
//! the one-shot commands (`generate`, `score`, `kld`, `fetch-default`, `bench`, `bench-serve`). Owns argument parsing and
//! terminal output only; all work is delegated to the library modules.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};

pub mod bench;
mod bench_glm5;
pub mod bench_serve;
pub mod cluster;
pub mod serve;

use crate::actors::drafter::{sources_for, LanePricing};
use crate::backend::cuda::Precision;
use crate::backend::{Backend, KvGeometry};
use crate::config::layers::{family_defaults, ModelFamily};
use crate::fidelity::{compare, LogitsFile};
use crate::generate::{
    make_backend, single_sequence_geometry, DeviceKind, DeviceSelection, GenerateError, GenerateOptions,
    ResolvedDevice, Runner, DEFAULT_PREFILL_CHUNK,
};
use crate::model::default_model::{fetch_default, CacheDir};
use crate::model::ModelBundle;
use crate::sampling::SamplingParams;
use crate::spec::draft_model::{DraftModelOptions, VocabIdentity};
use crate::spec::{validate_num_tokens, DraftError, SpeculativeMethod, MAX_SPECULATIVE_TOKENS};
use crate::tokenizer::chat::{ChatRender, ChatTemplate};
use crate::tokenizer::detok::IncrementalDetokenizer;

#[derive(Parser, Debug)]
#[command(name = "shelfserve", version, about = "LLM serving engine with an OpenAI-compatible API")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve the OpenAI-compatible API on every lane port (the default command).
    Serve(serve::ServeArgs),
    /// Generate a completion and stream it to stdout.
    Generate(GenerateArgs),
    /// Teacher-forced logits for every position, written to a safetensors file.
    Score(ScoreArgs),
    /// Compare our logits with a reference file (KL divergence, max |Δlogit|, top-1 agreement).
    Kld(KldArgs),
    /// Download and verify the embedded default model into the cache.
    FetchDefault,
    /// Benchmark the CUDA backend on seeded random weights for a config file, against the
    /// device's measured copy bandwidth and GEMM rate.
    Bench(bench::BenchArgs),
    /// Load-test an OpenAI-compatible server (ours or another): fixed concurrency or Poisson
    /// rate, streamed; reports throughput and TTFT/TPOT/ITL/E2E percentiles.
    BenchServe(bench_serve::BenchServeArgs),
    /// One more tensor-parallel rank for a `serve --head` on this or another host (the same
    /// model files on every host): joins the head's cluster and runs the steps it is sent.
    Worker(cluster::WorkerArgs),
}

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: `default` (SmolLM2-135M-Instruct), an HF model directory, or a `.gguf` file.
    #[arg(long, env = "SHELFSERVE_MODEL", default_value = "default")]
    pub model: String,
    /// Compute device: cpu, cuda or auto.
    #[arg(long, env = "SHELFSERVE_DEVICE", default_value = "auto")]
    pub device: String,
    /// CPU worker threads (0 = one per core).
    #[arg(long, env = "SHELFSERVE_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// Tensor-parallel ranks the model is split over (CPU: one thread group per rank; CUDA: one
    /// GPU per rank, devices --cuda-device.., joined by NCCL). glm5_next: CPU ranks only.
    #[arg(
        long = "tensor-parallel-size",
        visible_alias = "tp",
        env = "SHELFSERVE_TENSOR_PARALLEL_SIZE",
        default_value_t = 1
    )]
    pub tensor_parallel_size: usize,
    /// With --tensor-parallel-size N on a mixture-of-experts model (glm5_next): each rank holds
    /// E/N whole routed experts instead of a 1/N slice of every expert.
    #[arg(long = "enable-expert-parallel", env = "SHELFSERVE_ENABLE_EXPERT_PARALLEL")]
    pub enable_expert_parallel: bool,
    /// CUDA device ordinal (with --device cuda or auto).
    #[arg(long, env = "SHELFSERVE_CUDA_DEVICE", default_value_t = 0)]
    pub cuda_device: usize,
    /// CUDA storage precision of weights and KV cache: bf16, or f32 (validation).
    #[arg(long, env = "SHELFSERVE_CUDA_PRECISION", default_value = "bf16")]
    pub cuda_precision: String,
    /// Tokens per KV block [default: the model family's: 16, glm5_next 64; `serve` also reads
    /// the configuration file's block_size, which this flag overrides only when given].
    #[arg(long, env = "SHELFSERVE_BLOCK_SIZE")]
    pub block_size: Option<usize>,
    /// Prefill chunk size in tokens.
    #[arg(long, env = "SHELFSERVE_PREFILL_CHUNK", default_value_t = DEFAULT_PREFILL_CHUNK)]
    pub prefill_chunk: usize,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Plain-text prompt (BOS added as the model says).
    #[arg(long, env = "SHELFSERVE_PROMPT", conflicts_with_all = ["chat", "input_ids"])]
    pub prompt: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long, env = "SHELFSERVE_CHAT", conflicts_with = "input_ids")]
    pub chat: Option<String>,
    /// Prompt token ids, comma-separated (works without a tokenizer).
    #[arg(long, env = "SHELFSERVE_INPUT_IDS", value_delimiter = ',')]
    pub input_ids: Option<Vec<u32>>,
    #[arg(long, env = "SHELFSERVE_MAX_TOKENS", default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, env = "SHELFSERVE_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, env = "SHELFSERVE_TOP_P", default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, env = "SHELFSERVE_TOP_K", default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, env = "SHELFSERVE_MIN_P", default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, env = "SHELFSERVE_REPETITION_PENALTY", default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long, env = "SHELFSERVE_SEED", default_value_t = 0)]
    pub seed: u64,
    /// Print the generated token ids (comma-separated) instead of text.
    #[arg(long, env = "SHELFSERVE_PRINT_IDS")]
    pub print_ids: bool,
    /// Speculative decoding: `none`, `ngram` (suffix match over the prompt and output),
    /// `draft:PATH` (a smaller checkpoint with the same tokenizer) or `dflash:DIR` (a DFlash /
    /// DFlash2 block drafter that reads the target's hidden states).
    #[arg(long, env = "SHELFSERVE_SPECULATIVE", default_value = "none")]
    pub speculative: String,
    /// Draft tokens verified per step (1..=7).
    #[arg(long, env = "SHELFSERVE_NUM_SPECULATIVE_TOKENS", default_value_t = crate::spec::MAX_SPECULATIVE_TOKENS)]
    pub num_speculative_tokens: usize,
    /// An image (PNG, JPEG, WebP, GIF) for the prompt; repeat in order. With --chat the images
    /// come before the text in the user message and their placeholders are expanded as the
    /// server does; with --input-ids the ids must hold each image's placeholder run already
    /// (as for `score --image`). Processed with the model's `preprocessor_config.json`.
    #[arg(long = "image", value_name = "FILE", conflicts_with = "prompt")]
    pub images: Vec<PathBuf>,
}

#[derive(Args, Debug)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Token ids to score, comma-separated.
    #[arg(long, env = "SHELFSERVE_INPUT_IDS", value_delimiter = ',', required = true)]
    pub input_ids: Vec<u32>,
    /// Output safetensors file (tensors `input_ids` and `logits`).
    #[arg(long, env = "SHELFSERVE_OUTPUT")]
    pub output: PathBuf,
    /// An image (PNG, JPEG, WebP, GIF) for the next run of image placeholder ids in
    /// --input-ids, which must already be expanded as transformers' processor writes them;
    /// repeat in order. Processed by the engine with the model's `preprocessor_config.json`.
    #[arg(long = "image", value_name = "FILE")]
    pub images: Vec<PathBuf>,
}

#[derive(Args, Debug)]
pub struct KldArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Reference safetensors file with `input_ids` and `logits` (as `score` writes).
    #[arg(long, env = "SHELFSERVE_REFERENCE")]
    pub reference: PathBuf,
}

/// Errors of the one-shot commands, mapped to messages at the binary edge.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Generate(#[from] crate::generate::GenerateError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    LogitsFile(#[from] crate::fidelity::LogitsFileError),
    #[error(transparent)]
    Sampling(#[from] crate::sampling::SamplingError),
    #[error("{0}")]
    Usage(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

impl ModelArgs {
    pub fn open(&self) -> Result<ModelBundle, CliError> {
        self.device_selection()?;
        if self.block_size == Some(0) {
            return Err(CliError::Usage("--block-size must be positive".into()));
        }
        let bundle = crate::model::open(&self.model, &CacheDir::from_env())?;
        tracing::info!(model = %bundle.name, arch = %bundle.config.model_type, layers = bundle.config.num_hidden_layers, "model opened");
        Ok(bundle)
    }

    /// The device flags, checked.
    pub fn device_selection(&self) -> Result<DeviceSelection, CliError> {
        let kind: DeviceKind = self.device.parse().map_err(CliError::Usage)?;
        let cuda_precision = match self.cuda_precision.as_str() {
            "bf16" => Precision::Bf16,
            "f32" => Precision::F32,
            other => return Err(CliError::Usage(format!("--cuda-precision must be bf16 or f32, not `{other}`"))),
        };
        if self.tensor_parallel_size == 0 {
            return Err(CliError::Usage("--tensor-parallel-size must be at least 1".into()));
        }
        Ok(DeviceSelection {
            kind,
            threads: self.threads,
            cuda_ordinal: self.cuda_device,
            cuda_precision,
            tensor_parallel: self.tensor_parallel_size,
            expert_parallel: self.enable_expert_parallel,
        })
    }

    /// A one-sequence runner for `tokens` positions on `device` (resolved once by the command).
    fn runner(
        &self,
        bundle: &ModelBundle,
        device: &ResolvedDevice,
        tokens: usize,
    ) -> Result<Runner<Box<dyn Backend>>, CliError> {
        let family = ModelFamily::of_model_type(&bundle.config.model_type);
        let block_size = self.block_size.or(family_defaults(family).block_size).unwrap_or(16);
        let geom: KvGeometry = single_sequence_geometry(tokens, block_size);
        let backend = make_backend(bundle, device, geom).map_err(GenerateError::from)?;
        Ok(Runner::new(backend))
    }
}

pub fn run_generate(args: &GenerateArgs) -> Result<(), CliError> {
    let bundle = args.model.open()?;
    let tok = bundle.tokenizer.clone().map(Arc::new);
    let prompt: Vec<u32> = match (&args.prompt, &args.chat, &args.input_ids) {
        (_, _, Some(ids)) => ids.clone(),
        (Some(p), _, _) => {
            let t = tok.as_ref().ok_or_else(|| no_tokenizer(&bundle, "--prompt"))?;
            t.encode(p, true)?
        }
        (None, Some(c), _) => {
            let t = tok.as_ref().ok_or_else(|| no_tokenizer(&bundle, "--chat"))?;
            let src = t.chat_template.as_deref().ok_or_else(|| {
                CliError::Usage(format!("model `{}` has no chat template; use --prompt instead of --chat", bundle.name))
            })?;
            let tmpl = ChatTemplate::new(src, t.bos_token.as_deref(), t.eos_token.as_deref())?;
            let messages = if args.images.is_empty() {
                serde_json::json!([{"role": "user", "content": c}])
            } else {
                let mut parts = vec![serde_json::json!({"type": "image"}); args.images.len()];
                parts.push(serde_json::json!({"type": "text", "text": c}));
                serde_json::json!([{"role": "user", "content": parts}])
            };
            let text = tmpl.render(&ChatRender {
                messages: &messages,
                tools: None,
                add_generation_prompt: true,
                kwargs: &serde_json::Map::new(),
            })?;
            t.encode(&text, false)?
        }
        (None, None, None) => return Err(CliError::Usage("give one of --prompt, --chat or --input-ids".into())),
    };
    let images = load_images(&args.images, bundle.weights.origin())?;
    let prompt = if args.chat.is_some() && args.input_ids.is_none() && !images.is_empty() {
        expand_chat_images(&bundle, prompt, &images)?
    } else {
        prompt
    };
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        ..SamplingParams::default()
    };
    sampling.validate()?;
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling,
        eos_token_ids: bundle.eos_token_ids(),
        prefill_chunk: args.model.prefill_chunk,
    };
    let method: SpeculativeMethod =
        args.speculative.parse().map_err(|e: DraftError| CliError::Usage(format!("--speculative: {e}")))?;
    let k = validate_num_tokens(args.num_speculative_tokens)
        .map_err(|e| CliError::Usage(format!("--num-speculative-tokens: {e}")))?;
    // A draft model gets a store for this one sequence (its drafts included).
    // Resolved once: the verification price, the backend and a DFlash drafter's device follow it.
    let device = args.model.device_selection()?.resolve();
    let draft_opts = DraftModelOptions {
        threads: args.model.threads,
        pool_tokens: prompt.len() + args.max_tokens + MAX_SPECULATIVE_TOKENS,
        dflash_cuda: crate::spec::dflash::device_for(&device),
    };
    let row_cost = crate::spec::adaptive::verify_row_cost_for(device.kind);
    let pricing = LanePricing { row_cost, draft_cost: None };
    let target = VocabIdentity::of(&bundle);
    let mut drafter = sources_for(&[method], &[pricing], &bundle, &target, bundle.stored_weight_bytes(), draft_opts)
        .map_err(|e| CliError::Usage(format!("--speculative: {e}")))?
        .pop()
        .flatten();
    let mut runner = args.model.runner(&bundle, &device, prompt.len() + args.max_tokens)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let print_ids = args.print_ids || tok.is_none();
    let mut detok = tok.as_ref().map(|t| IncrementalDetokenizer::new(Arc::clone(t), true));
    let mut io_err = None;
    let mut first = true;
    let start = std::time::Instant::now();
    let drafts: Option<(&mut dyn crate::spec::DraftSource, usize)> = match drafter.as_mut() {
        Some(d) => Some((d.as_mut(), k)),
        None => None,
    };
    let result = runner.generate_with_images(&prompt, &images, &opts, drafts, |s| {
        let res = if print_ids {
            let r = write!(out, "{}{}", if first { "" } else { "," }, s.token);
            first = false;
            r
        } else if let Some(d) = detok.as_mut() {
            match d.push(s.token) {
                Ok(text) => write!(out, "{text}"),
                Err(e) => Err(std::io::Error::other(e.to_string())),
            }
        } else {
            Ok(())
        };
        let res = res.and_then(|_| out.flush());
        if let Err(e) = res {
            io_err = Some(e);
            return false;
        }
        true
    })?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    if !print_ids {
        if let Some(d) = detok.as_mut() {
            write!(out, "{}", d.finish()?)?;
        }
    }
    writeln!(out)?;
    let secs = start.elapsed().as_secs_f64();
    tracing::info!(
        prompt_tokens = prompt.len(),
        generated = result.tokens.len(),
        finish = ?result.finish,
        tok_per_s = format!("{:.1}", result.tokens.len() as f64 / secs.max(1e-9)),
        "done"
    );
    Ok(())
}

fn no_tokenizer(bundle: &ModelBundle, flag: &str) -> CliError {
    CliError::Usage(format!("model `{}` has no tokenizer, so {flag} cannot be used; pass --input-ids", bundle.name))
}

pub fn run_score(args: &ScoreArgs) -> Result<(), CliError> {
    let bundle = args.model.open()?;
    let device = args.model.device_selection()?.resolve();
    let images = load_images(&args.images, bundle.weights.origin())?;
    let mut runner = args.model.runner(&bundle, &device, args.input_ids.len())?;
    let logits = runner.score_with_images(&args.input_ids, args.model.prefill_chunk, &images)?;
    let file = LogitsFile { input_ids: args.input_ids.clone(), vocab: bundle.config.vocab_size, logits };
    file.write(&args.output)?;
    println!(
        "wrote {} positions × {} logits to {}",
        args.input_ids.len(),
        bundle.config.vocab_size,
        args.output.display()
    );
    Ok(())
}

/// Expand the chat template's one image placeholder per image into each image's run, as the
/// server does (`api::media`).
fn expand_chat_images(
    bundle: &ModelBundle,
    ids: Vec<u32>,
    images: &[crate::media::ProcessedImage],
) -> Result<Vec<u32>, CliError> {
    let Some((vc, mm)) = crate::model::glm5_next::vision::read_vision_config(bundle.weights.origin())? else {
        return Err(CliError::Usage(format!("model `{}` has no vision tower, so it takes no --image", bundle.name)));
    };
    let counts: Vec<usize> = images.iter().map(|i| i.tokens(vc.spatial_merge_size)).collect();
    crate::media::expand_placeholders(&ids, mm.image_token_id, &counts)
        .map(|(ids, _)| ids)
        .ok_or_else(|| CliError::Usage("the chat template does not write one image placeholder per image".into()))
}

/// Decode and process `paths` with the processor settings of the model in `model_dir`.
fn load_images(paths: &[PathBuf], model_dir: &Path) -> Result<Vec<crate::media::ProcessedImage>, CliError> {
    use crate::media::{decode_image, DecodeLimits, ImageProcessor};
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let processor = ImageProcessor::from_dir(model_dir).map_err(|e| CliError::Usage(e.to_string()))?;
    paths
        .iter()
        .map(|p| {
            let bytes = std::fs::read(p).map_err(|e| CliError::Usage(format!("{}: {e}", p.display())))?;
            decode_image(&bytes, DecodeLimits::default())
                .and_then(|img| processor.process(&img))
                .map_err(|e| CliError::Usage(format!("{}: {e}", p.display())))
        })
        .collect()
}

pub fn run_kld(args: &KldArgs) -> Result<(), CliError> {
    let reference = LogitsFile::read(&args.reference)?;
    let bundle = args.model.open()?;
    if reference.vocab != bundle.config.vocab_size {
        return Err(CliError::Usage(format!(
            "{}: reference vocabulary is {}, model `{}` has {}",
            args.reference.display(),
            reference.vocab,
            bundle.name,
            bundle.config.vocab_size
        )));
    }
    let device = args.model.device_selection()?.resolve();
    let mut runner = args.model.runner(&bundle, &device, reference.input_ids.len())?;
    let ours = runner.score(&reference.input_ids, args.model.prefill_chunk)?;
    compare(&reference.logits, &ours, reference.vocab).print(std::io::stdout().lock())?;
    Ok(())
}

pub fn run_fetch_default() -> Result<(), CliError> {
    let path = fetch_default(&CacheDir::from_env(), true)?;
    println!("{}", path.display());
    Ok(())
}
