//! `shelfserve serve` (also what a bare `shelfserve` runs): open the model, start the engine
//! actors, and serve every lane's OpenAI-compatible API until interrupted.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::{CliError, ModelArgs};
use crate::actors::engine::start_engine_with;
use crate::actors::{EngineOptions, InferenceEngine};
use crate::api::auth::{read_key_file, AuthPolicy};
use crate::api::media::MediaOptions;
use crate::api::{bind_all, ApiOptions};
use crate::config::engine::{EngineConfig, DEFAULT_CONFIG_TOML};
use crate::config::layers::{DeviceClass, EngineFile, ModelFamily, Provenance, SchedulerKnobs};
use crate::generate::{DeviceKind, ResolvedKind};
use crate::media::fetch::Fetcher;
use crate::media::remote::RemotePolicy;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Serving configuration (lanes, budgets); the built-in `configs/default.toml` when absent.
    /// Its keys beat the model family's and the device's defaults; flags and environment
    /// variables beat it.
    #[arg(long, env = "SHELFSERVE_CONFIG")]
    pub config: Option<PathBuf>,
    /// Listen address for every lane.
    #[arg(long, env = "SHELFSERVE_HOST")]
    pub host: Option<String>,
    /// Lane ports, e.g. `voice=8888,agent=8889` (0 = any free port).
    #[arg(long, env = "SHELFSERVE_LANE_PORTS", value_delimiter = ',')]
    pub lane_port: Vec<String>,
    /// Require `Authorization: Bearer <key>` on every route but /health (and /metrics with
    /// --metrics-public).
    #[arg(long, env = "SHELFSERVE_API_KEY")]
    pub api_key: Option<String>,
    /// A file of accepted keys, one per line (`#` starts a comment line); adds to --api-key.
    #[arg(long, env = "SHELFSERVE_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Serve /metrics without a key even when keys are set.
    #[arg(long, env = "SHELFSERVE_METRICS_PUBLIC")]
    pub metrics_public: bool,
    /// Model id reported by /v1/models (default: the model's name).
    #[arg(long, env = "SHELFSERVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Sequences one step may carry [default: 32 on the CPU, 256 on CUDA].
    #[arg(long, env = "SHELFSERVE_MAX_NUM_SEQS")]
    pub max_num_seqs: Option<usize>,
    /// Tokens one step may carry [default: 512 on the CPU, 8192 on CUDA; glm5_next 7168].
    #[arg(long, env = "SHELFSERVE_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<usize>,
    /// KV pool size in tokens [default: on CUDA what --gpu-memory-utilization leaves after the
    /// weights and the step workspace; on the CPU two full contexts, checked against host memory].
    #[arg(long, env = "SHELFSERVE_KV_POOL_TOKENS")]
    pub kv_pool_tokens: Option<usize>,
    /// Share of each GPU's total memory the engine may use for weights, workspace and KV pool
    /// [default: 0.90].
    #[arg(long, env = "SHELFSERVE_GPU_MEMORY_UTILIZATION")]
    pub gpu_memory_utilization: Option<f64>,
    /// Size lower lanes' prefill to higher lanes' latency targets (`true`/`false`) [default: true].
    #[arg(long, env = "SHELFSERVE_LANE_PACING", value_name = "BOOL")]
    pub lane_pacing: Option<bool>,
    /// Plan each decode step while the device runs the one before it (`true`/`false`)
    /// [default: true; one rank only].
    #[arg(long, env = "SHELFSERVE_OVERLAP_SCHEDULING", value_name = "BOOL")]
    pub overlap_scheduling: Option<bool>,
    /// With lane pacing: a step of lower-lane prefill stops at a layer boundary when a higher
    /// lane gets work, and resumes after it (`true`/`false`) [default: true; CPU llama-family
    /// models, one rank].
    #[arg(long, env = "SHELFSERVE_YIELD_LOWER_PREFILL", value_name = "BOOL")]
    pub yield_lower_prefill: Option<bool>,
    /// With yielding: while a lane with latency targets decodes and a lower lane prefills, the
    /// lane's decodes run in steps of their own, so the lower prefill steps between them yield to
    /// its next request (`true`/`false`) [default: true on the CPU, false on CUDA].
    #[arg(long, env = "SHELFSERVE_SEPARATE_LANE_DECODES", value_name = "BOOL")]
    pub separate_lane_decodes: Option<bool>,
    /// Speculative decoding for every lane: `none`, `ngram` (model-free suffix match), `mtp`
    /// (a glm5_next checkpoint's own MTP layer; CPU backend), `draft:PATH` or `dflash:DIR` (a
    /// DFlash block drafter reading the target's hidden states);
    /// overrides each lane's `speculative` in the configuration.
    #[arg(long, env = "SHELFSERVE_SPECULATIVE")]
    pub speculative: Option<String>,
    /// Draft tokens verified per step, 1..=7 (default 7); overrides every lane's setting.
    #[arg(long, env = "SHELFSERVE_NUM_SPECULATIVE_TOKENS")]
    pub num_speculative_tokens: Option<usize>,
    /// Prefix-cache page size in tokens, a multiple of the block size [default: 256 for llama,
    /// 3584 for glm5_next].
    #[arg(long, env = "SHELFSERVE_PAGE_TOKENS")]
    pub page_tokens: Option<usize>,
    /// Directory for evicted KV pages (spill tier).
    #[arg(long, env = "SHELFSERVE_SPILL_DIR")]
    pub spill_dir: Option<String>,
    /// Bytes the spill directory may hold (0 turns spill off).
    #[arg(long, env = "SHELFSERVE_SPILL_BUDGET")]
    pub spill_budget: Option<u64>,
    /// Bytes of recently evicted pages kept in host memory in front of the spill directory
    /// [default: 0 on the CPU, 16 GiB on CUDA, at most a quarter of the available memory].
    #[arg(long, env = "SHELFSERVE_SPILL_HOST_BYTES")]
    pub spill_host_bytes: Option<u64>,
    /// Boxed: the serve command's arguments are the largest of the CLI's commands already.
    #[command(flatten)]
    pub http: Box<HttpArgs>,
    #[command(flatten)]
    pub cluster: Box<super::cluster::HeadArgs>,
    /// Print the resolved scheduler configuration (each knob with its source) and the capacity
    /// card, then exit without loading the weights.
    #[arg(long, env = "SHELFSERVE_DRY_RUN")]
    pub dry_run: bool,
    /// Seconds a SIGTERM/SIGINT waits for in-flight requests before cancelling them (then as
    /// long again for writing cached pages to the spill tier); a second signal exits at once.
    #[arg(long, env = "SHELFSERVE_SHUTDOWN_TIMEOUT", default_value_t = 30.0, value_name = "SECONDS")]
    pub shutdown_timeout: f64,
}

/// How the HTTP edge is exposed: TLS, browser origins, client timeouts.
#[derive(Args, Debug, Clone)]
pub struct HttpArgs {
    /// Serve HTTPS with this PEM certificate chain (needs --tls-key).
    #[arg(long, env = "SHELFSERVE_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "SHELFSERVE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Browser origins allowed to call the API (CORS), e.g. `https://app.example.com`; none by
    /// default, so web pages on other origins cannot use the server.
    #[arg(long, env = "SHELFSERVE_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Seconds a client has to send its request line and headers.
    #[arg(long, env = "SHELFSERVE_HEADER_READ_TIMEOUT", default_value_t = ApiOptions::DEFAULT_HEADER_READ_TIMEOUT.as_secs_f64())]
    pub header_read_timeout: f64,
    /// Seconds a client has to send a request body.
    #[arg(long, env = "SHELFSERVE_BODY_READ_TIMEOUT", default_value_t = ApiOptions::DEFAULT_BODY_READ_TIMEOUT.as_secs_f64())]
    pub body_read_timeout: f64,
    /// Images may come as `file://` URLs of files inside this directory (resolved through links
    /// first); without it, only `data:` URLs and base64 sources are accepted.
    #[arg(long, env = "SHELFSERVE_ALLOWED_LOCAL_MEDIA_PATH", value_name = "DIR")]
    pub allowed_local_media_path: Option<PathBuf>,
    /// Fetch `http(s)://` image and video URLs (off: a 400 naming this flag). Hosts that resolve
    /// to loopback, private, link-local or other internal addresses are refused unless listed in
    /// --allowed-media-domains (docs/vision.md).
    #[arg(long, env = "SHELFSERVE_ALLOW_REMOTE_MEDIA")]
    pub allow_remote_media: bool,
    /// With --allow-remote-media: fetch only from these hosts (comma list, exact names or IP
    /// literals), whatever addresses they resolve to.
    #[arg(long, env = "SHELFSERVE_ALLOWED_MEDIA_DOMAINS", value_name = "HOSTS")]
    pub allowed_media_domains: Option<String>,
    /// Seconds one remote media fetch may take in all (redirects, headers and body).
    #[arg(long, env = "SHELFSERVE_MEDIA_FETCH_TIMEOUT", default_value_t = RemotePolicy::DEFAULT_TIMEOUT.as_secs_f64())]
    pub media_fetch_timeout: f64,
    /// A PEM file of root certificates trusted for https media besides the built-in Mozilla roots.
    #[arg(long, env = "SHELFSERVE_MEDIA_EXTRA_CA", value_name = "FILE")]
    pub media_extra_ca: Option<PathBuf>,
    /// Images one request may carry (more: 400).
    #[arg(long, env = "SHELFSERVE_MAX_IMAGES_PER_REQUEST", default_value_t = MediaOptions::DEFAULT_MAX_IMAGES)]
    pub max_images_per_request: usize,
    /// Decoded width × height one image may have (more: 400, checked before decoding the pixels).
    #[arg(long, env = "SHELFSERVE_MAX_IMAGE_PIXELS", default_value_t = MediaOptions::DEFAULT_MAX_PIXELS)]
    pub max_image_pixels: u64,
    /// Encoded bytes one image may have (more: 400).
    #[arg(long, env = "SHELFSERVE_MAX_IMAGE_BYTES", default_value_t = MediaOptions::DEFAULT_MAX_BYTES)]
    pub max_image_bytes: usize,
    /// Videos one request may carry (more: 400).
    #[arg(long, env = "SHELFSERVE_MAX_VIDEOS_PER_REQUEST", default_value_t = MediaOptions::DEFAULT_MAX_VIDEOS)]
    pub max_videos_per_request: usize,
    /// Frames of one video that reach the model: a frame list's length, or what sampling keeps of
    /// a decoded container (more: 400).
    #[arg(long, env = "SHELFSERVE_MAX_VIDEO_FRAMES", default_value_t = MediaOptions::DEFAULT_MAX_VIDEO_FRAMES)]
    pub max_video_frames: usize,
    /// Encoded bytes of one video container (more: 400).
    #[arg(long, env = "SHELFSERVE_MAX_VIDEO_BYTES", default_value_t = MediaOptions::DEFAULT_MAX_VIDEO_BYTES)]
    pub max_video_bytes: usize,
}

impl HttpArgs {
    /// Fill `opts` with these settings; TLS files are read now, so a bad one stops startup.
    pub fn apply(&self, opts: &mut ApiOptions) -> Result<(), CliError> {
        let secs = |name: &str, v: f64| {
            std::time::Duration::try_from_secs_f64(v)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| CliError::Usage(format!("--{name} must be a positive number of seconds, not {v}")))
        };
        opts.header_read_timeout = secs("header-read-timeout", self.header_read_timeout)?;
        opts.body_read_timeout = secs("body-read-timeout", self.body_read_timeout)?;
        opts.allowed_origins = self.allowed_origins.iter().map(|o| o.trim().trim_end_matches('/').to_owned()).collect();
        if let Some(dir) = &self.allowed_local_media_path {
            if !dir.is_dir() {
                return Err(CliError::Usage(format!("--allowed-local-media-path {}: not a directory", dir.display())));
            }
        }
        let fetcher = if self.allow_remote_media {
            let policy = RemotePolicy {
                allowed_domains: self.allowed_media_domains.as_deref().map(RemotePolicy::domains_from_list),
                timeout: secs("media-fetch-timeout", self.media_fetch_timeout)?,
                max_redirects: RemotePolicy::DEFAULT_MAX_REDIRECTS,
            };
            Some(Arc::new(Fetcher::new(policy, self.media_extra_ca.as_deref()).map_err(CliError::Usage)?))
        } else {
            if self.allowed_media_domains.is_some() || self.media_extra_ca.is_some() {
                return Err(CliError::Usage(
                    "--allowed-media-domains and --media-extra-ca apply to remote media: add --allow-remote-media"
                        .into(),
                ));
            }
            None
        };
        opts.media = MediaOptions {
            allowed_local_path: self.allowed_local_media_path.clone(),
            allow_remote: self.allow_remote_media,
            fetcher,
            max_images: self.max_images_per_request,
            max_pixels: self.max_image_pixels,
            max_bytes: self.max_image_bytes,
            max_videos: self.max_videos_per_request,
            max_video_frames: self.max_video_frames,
            max_video_bytes: self.max_video_bytes,
        };
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            opts.tls = Some(crate::api::tls::server_config(cert, key).map_err(|e| CliError::Usage(e.to_string()))?);
        }
        Ok(())
    }
}

impl ServeArgs {
    /// The configuration file as written (`--config`, else the built-in one).
    pub fn config_file(&self) -> Result<EngineFile, CliError> {
        match &self.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| CliError::Usage(format!("--config {}: {e}", p.display())))?;
                EngineFile::from_toml(&text, &p.display().to_string()).map_err(|e| CliError::Usage(e.to_string()))
            }
            None => EngineFile::from_toml(DEFAULT_CONFIG_TOML, "configs/default.toml")
                .map_err(|e| CliError::Usage(e.to_string())),
        }
    }

    /// The scheduler knobs given as flags or environment variables (`None` where neither is).
    pub fn command_line_knobs(&self) -> SchedulerKnobs {
        SchedulerKnobs {
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            block_size: self.model.block_size,
            kv_pool_tokens: self.kv_pool_tokens,
            page_tokens: self.page_tokens,
            spill_dir: self.spill_dir.clone(),
            spill_budget: self.spill_budget,
            spill_host_bytes: self.spill_host_bytes,
            gpu_memory_utilization: self.gpu_memory_utilization,
            lane_pacing: self.lane_pacing,
            overlap_scheduling: self.overlap_scheduling,
            yield_lower_prefill: self.yield_lower_prefill,
            separate_lane_decodes: self.separate_lane_decodes,
        }
    }

    /// The configuration: flags and environment over the file (or the built-in one) over the
    /// model family's and the device's defaults; with where each scheduler knob came from.
    pub fn engine_config(
        &self,
        family: ModelFamily,
        device: DeviceClass,
    ) -> Result<(EngineConfig, Provenance), CliError> {
        let (mut cfg, provenance) = self
            .config_file()?
            .resolve(&self.command_line_knobs(), self.host.as_deref(), family, device)
            .map_err(|e| CliError::Usage(format!("configuration: {e}")))?;
        for spec in &self.lane_port {
            let (name, port) = spec
                .split_once('=')
                .ok_or_else(|| CliError::Usage(format!("--lane-port `{spec}`: expected NAME=PORT")))?;
            let port: u16 = port.parse().map_err(|_| CliError::Usage(format!("--lane-port `{spec}`: bad port")))?;
            let lane = cfg.lanes.iter_mut().find(|l| l.name == name).ok_or_else(|| {
                CliError::Usage(format!("--lane-port `{spec}`: no lane named `{name}` in the configuration"))
            })?;
            lane.port = port;
        }
        if let Some(m) = &self.speculative {
            let method: crate::spec::SpeculativeMethod =
                m.parse().map_err(|e: crate::spec::DraftError| CliError::Usage(format!("--speculative: {e}")))?;
            cfg.lanes.iter_mut().for_each(|l| l.speculative = method.clone());
        }
        if let Some(k) = self.num_speculative_tokens {
            cfg.lanes.iter_mut().for_each(|l| l.num_speculative_tokens = k);
        }
        cfg.validate().map_err(CliError::Usage)?;
        Ok((cfg, provenance))
    }
}

impl ServeArgs {
    /// The keys of --api-key and --api-key-file.
    pub fn auth_policy(&self) -> Result<AuthPolicy, CliError> {
        let mut keys: Vec<String> = self.api_key.iter().cloned().collect();
        if let Some(path) = &self.api_key_file {
            let from_file =
                read_key_file(path).map_err(|e| CliError::Usage(format!("--api-key-file {}: {e}", path.display())))?;
            keys.extend(from_file);
        }
        Ok(AuthPolicy::new(keys, self.metrics_public))
    }
}

/// `--dry-run`: the resolved knobs with their sources, and the capacity card, on stdout.
fn print_dry_run(
    bundle: &crate::model::ModelBundle,
    device: &crate::generate::ResolvedDevice,
    cfg: &EngineConfig,
    provenance: &Provenance,
) -> Result<(), CliError> {
    let s = &cfg.scheduler;
    let source = |knob: &str| provenance.of(knob).map_or("unset", |src| src.as_str());
    for (knob, value) in [
        ("max_num_seqs", s.max_num_seqs.to_string()),
        ("max_num_batched_tokens", s.max_num_batched_tokens.to_string()),
        ("block_size", s.block_size.to_string()),
        ("page_tokens", s.page_tokens.to_string()),
        ("kv_pool_tokens", s.kv_pool_tokens.to_string()),
        ("gpu_memory_utilization", s.gpu_memory_utilization.to_string()),
        ("spill_dir", s.spill_dir.clone().unwrap_or_default()),
        ("spill_budget", s.spill_budget.to_string()),
        ("spill_host_bytes", s.spill_host_bytes.to_string()),
    ] {
        println!("{knob} = {value} ({})", source(knob));
    }
    for l in &cfg.lanes {
        println!("lane {} port = {} max_queue = {}", l.name, l.port, l.max_queue);
    }
    let memory = crate::capacity::probe(device).map_err(CliError::Usage)?;
    let page = if s.page_tokens > 0 { s.page_tokens } else { crate::actors::engine::DEFAULT_LLAMA_PAGE_TOKENS };
    let card = crate::capacity::plan(bundle, device, s, page, memory).map_err(CliError::Usage)?;
    println!("weights_bytes = {}", card.weight_bytes);
    println!("kv_dtype = {}", card.kv.dtype.as_str());
    println!("kv_bytes_per_token = {}", card.kv.bytes_per_token);
    println!("state_bytes_per_sequence = {}", card.kv.state_slot_bytes);
    println!("pool_tokens = {} ({:?})", card.pool_tokens, card.pool_sized_by);
    println!("kv_pool_bytes = {}", card.kv_pool_bytes());
    println!("max_context = {}", card.max_context);
    Ok(())
}

/// Anyone who can reach a non-loopback address can use an unkeyed server.
fn warn_if_exposed(host: &str, auth: &AuthPolicy) {
    let loopback = host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback && !auth.enabled() {
        tracing::warn!(
            host,
            "listening on a non-loopback address without an API key: anyone who can reach it can use the model \
             (set --api-key or --api-key-file)"
        );
    }
}

pub fn run_serve(args: &ServeArgs) -> Result<(), CliError> {
    // A broken file is reported before the model is opened (which may download it).
    args.config_file()?;
    let bundle = args.model.open()?;
    // Settle `auto` once: the defaults, the card and every rank's backend follow it.
    let resolved = args.model.device_selection()?.resolve();
    let (device_class, kind) = match resolved.kind {
        ResolvedKind::Cpu => (DeviceClass::Cpu, DeviceKind::Cpu),
        ResolvedKind::Cuda => (DeviceClass::Cuda, DeviceKind::Cuda),
    };
    let (cfg, provenance) = args.engine_config(ModelFamily::of_model_type(&bundle.config.model_type), device_class)?;
    tracing::info!(sources = %provenance.summary(), "scheduler configuration");
    if args.dry_run {
        return print_dry_run(&bundle, &resolved, &cfg, &provenance);
    }
    if bundle.tokenizer.is_none() {
        return Err(CliError::Usage(format!(
            "model `{}` has no tokenizer (tokenizer.json), so it cannot be served; use `generate --input-ids` or `score` with it",
            bundle.name
        )));
    }
    let served = args.served_model_name.clone().unwrap_or_else(|| bundle.name.clone());
    let metrics = crate::api::metrics::install_prometheus().map_err(|e| CliError::Usage(format!("metrics: {e}")))?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let head = args.cluster.start().await?;
        let engine = start_engine_with(
            bundle,
            cfg.clone(),
            EngineOptions {
                device: crate::generate::DeviceSelection { kind, ..args.model.device_selection()? },
                served_model_name: served.clone(),
            },
            head,
        )
        .await
        .map_err(|e| CliError::Usage(e.to_string()))?;
        let mut opts = ApiOptions::new(served).with_prometheus(metrics);
        opts.auth = args.auth_policy()?;
        args.http.apply(&mut opts)?;
        warn_if_exposed(&cfg.host, &opts.auth);
        let dyn_engine: Arc<dyn InferenceEngine> = engine.clone();
        let servers = bind_all(dyn_engine, &cfg, opts)?;
        let ports: Vec<String> = servers.iter().map(|s| format!("{}:{}", s.lane, s.port())).collect();
        tracing::info!(lanes = %ports.join(" "), "listening; /health answers 503 until the model is loaded");
        let handles: Vec<_> = servers.iter().map(|s| s.server.handle()).collect();
        let mut serving = std::pin::pin!(futures_util::future::try_join_all(servers.into_iter().map(|s| s.server)));
        let mut signals = shutdown_signals()?;
        tokio::select! {
            served = &mut serving => {
                served?;
                engine.shutdown();
                return Ok(());
            }
            Some(signal) = signals.recv() => {
                tracing::info!(signal, "draining: new requests get 503; a second signal exits at once")
            }
        }
        tokio::spawn(async move {
            if let Some(signal) = signals.recv().await {
                tracing::warn!(signal, "second signal: exiting without draining");
                std::process::exit(1);
            }
        });
        // The servers keep running (answering 503) while the engine drains, then stop.
        let timeout = std::time::Duration::from_secs_f64(args.shutdown_timeout.max(0.0));
        let drained = async {
            let report = engine.drain(timeout).await;
            for h in &handles {
                h.stop(true).await;
            }
            report
        };
        let (report, served) = tokio::join!(drained, serving);
        served?;
        engine.shutdown();
        tracing::info!(cancelled = report.cancelled, pages_on_disk = report.flushed, "drained; exiting");
        Ok(())
    })
}

/// Every SIGTERM and SIGINT from now on, by name (listened for once, so none is lost between
/// the first and the second).
fn shutdown_signals() -> std::io::Result<tokio::sync::mpsc::UnboundedReceiver<&'static str>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let name = tokio::select! {
                Some(()) = term.recv() => "SIGTERM",
                Some(()) = int.recv() => "SIGINT",
                else => break,
            };
            if tx.send(name).is_err() {
                break;
            }
        }
    });
    Ok(rx)
}
