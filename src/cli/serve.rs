//! `shelfserve serve` (also what a bare `shelfserve` runs): open the model, start the engine
//! actors, and serve every lane's OpenAI-compatible API until interrupted.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;

use super::{CliError, ModelArgs};
use crate::actors::{start_engine, EngineOptions, InferenceEngine};
use crate::api::auth::{read_key_file, AuthPolicy};
use crate::api::{bind_all, ApiOptions};
use crate::config::engine::EngineConfig;

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Serving configuration (lanes, budgets); the built-in `configs/default.toml` when absent.
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
    #[arg(long, env = "SHELFSERVE_MAX_NUM_SEQS")]
    pub max_num_seqs: Option<usize>,
    #[arg(long, env = "SHELFSERVE_MAX_NUM_BATCHED_TOKENS")]
    pub max_num_batched_tokens: Option<usize>,
    /// KV pool size in tokens.
    #[arg(long, env = "SHELFSERVE_KV_POOL_TOKENS")]
    pub kv_pool_tokens: Option<usize>,
    /// Speculative decoding for every lane: `none`, `ngram` (model-free suffix match) or
    /// `draft:PATH`; overrides each lane's `speculative` in the configuration.
    #[arg(long, env = "SHELFSERVE_SPECULATIVE")]
    pub speculative: Option<String>,
    /// Draft tokens verified per step, 1..=7 (default 7); overrides every lane's setting.
    #[arg(long, env = "SHELFSERVE_NUM_SPECULATIVE_TOKENS")]
    pub num_speculative_tokens: Option<usize>,
    /// Prefix-cache page size in tokens (a multiple of the block size; default 256 for llama).
    #[arg(long, env = "SHELFSERVE_PAGE_TOKENS")]
    pub page_tokens: Option<usize>,
    /// Directory for evicted KV pages (spill tier).
    #[arg(long, env = "SHELFSERVE_SPILL_DIR")]
    pub spill_dir: Option<String>,
    /// Bytes the spill directory may hold (0 turns spill off).
    #[arg(long, env = "SHELFSERVE_SPILL_BUDGET")]
    pub spill_budget: Option<u64>,
    /// Boxed: the serve command's arguments are the largest of the CLI's commands already.
    #[command(flatten)]
    pub http: Box<HttpArgs>,
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
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            opts.tls = Some(crate::api::tls::server_config(cert, key).map_err(|e| CliError::Usage(e.to_string()))?);
        }
        Ok(())
    }
}

impl ServeArgs {
    /// The configuration file (or the built-in one) with flag/env overrides applied.
    pub fn engine_config(&self) -> Result<EngineConfig, CliError> {
        let mut cfg = match &self.config {
            Some(p) => EngineConfig::load(p).map_err(|e| CliError::Usage(e.to_string()))?,
            None => EngineConfig::builtin(),
        };
        if let Some(h) = &self.host {
            cfg.host = h.clone();
        }
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
        let s = &mut cfg.scheduler;
        s.block_size = self.model.block_size;
        if let Some(v) = self.max_num_seqs {
            s.max_num_seqs = v;
        }
        if let Some(v) = self.max_num_batched_tokens {
            s.max_num_batched_tokens = v;
        }
        if let Some(v) = self.kv_pool_tokens {
            s.kv_pool_tokens = v;
        }
        if let Some(v) = self.page_tokens {
            s.page_tokens = v;
        }
        if let Some(v) = &self.spill_dir {
            s.spill_dir = Some(v.clone());
        }
        if let Some(v) = self.spill_budget {
            s.spill_budget = v;
        }
        cfg.validate().map_err(CliError::Usage)?;
        Ok(cfg)
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
    let cfg = args.engine_config()?;
    let bundle = args.model.open()?;
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
        let engine = start_engine(
            bundle,
            cfg.clone(),
            EngineOptions { device: args.model.device_selection()?, served_model_name: served.clone() },
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
        futures_util::future::try_join_all(servers.into_iter().map(|s| s.server)).await?;
        engine.shutdown();
        Ok(())
    })
}
