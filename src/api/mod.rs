//! The OpenAI-compatible HTTP API (actix-web): one server per lane port, speaking only to the
//! engine boundary ([`InferenceEngine`]: submit, receive a stream, drop it to cancel).
//!
//! Owns: server construction and binding (plain or TLS, `tls`), routing (405 with `Allow`), the
//! API-key gate (`auth`: deny by default on the normalized path, before the body is read), CORS
//! (off unless origins are configured), the strict body contract (`application/json` only, size
//! limit, header and body read deadlines),
//! `/health`, `/v1/models`, `/metrics`, and (in the submodules) request validation, prompt
//! rendering and tokenization (on the blocking pool, never on the async runtime), response and
//! SSE formatting, and the single error → HTTP mapping (`errors`). It holds no engine state: a
//! request's only link to the engine is its [`EventStream`]s, owned by the handler future or the
//! response body, so a client that disconnects drops them and the engine cancels the request.
//!
//! Connections are served with HTTP/1 half-closure disabled: a client that closes its socket
//! makes actix drop the handler future at once, which is what cancels a non-streaming request.

mod anthropic;
pub mod auth;
mod chat;
mod completions;
mod conversation;
pub mod errors;
pub mod media;
mod media_fetch;
mod media_video;
pub mod metrics;
mod output;
pub mod params;
pub mod reasoning;
mod sse;
mod structured;
pub mod tls;
mod tokenize;
mod tokens;
pub mod tools;
pub mod types;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use actix_cors::Cors;
use actix_web::body::MessageBody;
use actix_web::dev::{Server, ServiceFactory, ServiceRequest, ServiceResponse};
use actix_web::http::{header, Method};
use actix_web::middleware::Condition;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer, ResponseError};
use bytes::{Bytes, BytesMut};
use futures_util::future::Either;
use futures_util::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::actors::handle::{EventStream, GenerationRequest, InferenceEngine};
use crate::config::engine::{EngineConfig, LaneConfig};
use crate::tokenizer::chat::ChatTemplate;
use crate::tokenizer::literal::ChatEncoder;
use crate::tokenizer::TokenizerBundle;
use errors::ApiError;
use tokens::TokenPieces;

/// Renders the metrics exposition text for `/metrics`.
pub type MetricsRender = Arc<dyn Fn() -> String + Send + Sync>;

/// Settings shared by every lane server.
#[derive(Clone)]
pub struct ApiOptions {
    /// With keys, every route but `/health` (and `/metrics` when public) requires
    /// `Authorization: Bearer <key>`.
    pub auth: auth::AuthPolicy,
    /// The model id clients see in `/v1/models` and may send as `model`.
    pub served_model_name: String,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    /// `/metrics` renders this; `None` serves an empty exposition.
    pub metrics: Option<MetricsRender>,
    /// Worker threads per lane server (0: actix's default, one per physical core).
    pub workers: usize,
    /// A client must send its request line and headers within this time (else 408).
    pub header_read_timeout: Duration,
    /// A client must send its whole body within this time once the handler starts reading it
    /// (else 408): a slow sender cannot hold a connection and a worker's buffer forever.
    pub body_read_timeout: Duration,
    /// Origins whose browser pages may call the API (CORS); empty: no CORS headers at all, so a
    /// page on another origin can neither read replies nor pass a preflight.
    pub allowed_origins: Vec<String>,
    /// Serve HTTPS with this configuration instead of plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Where images may come from and how large they may be.
    pub media: media::MediaOptions,
}

impl ApiOptions {
    /// Room for a 1M-token prompt sent as a JSON list of ids.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;
    pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
    /// Enough for the largest body at a few hundred kB/s.
    pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

    pub fn new(served_model_name: impl Into<String>) -> Self {
        Self {
            auth: auth::AuthPolicy::default(),
            served_model_name: served_model_name.into(),
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            metrics: None,
            workers: 0,
            header_read_timeout: Self::DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: Self::DEFAULT_BODY_READ_TIMEOUT,
            allowed_origins: Vec::new(),
            tls: None,
            media: media::MediaOptions::default(),
        }
    }

    /// Serve `handle` on `/metrics`; each scrape runs the exporter's upkeep first, so histograms
    /// are drained without a background timer.
    pub fn with_prometheus(mut self, handle: PrometheusHandle) -> Self {
        self.metrics = Some(Arc::new(move || {
            handle.run_upkeep();
            handle.render()
        }));
        self
    }
}

impl std::fmt::Debug for ApiOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiOptions")
            .field("auth", &self.auth)
            .field("served_model_name", &self.served_model_name)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("metrics", &self.metrics.is_some())
            .field("workers", &self.workers)
            .field("header_read_timeout", &self.header_read_timeout)
            .field("body_read_timeout", &self.body_read_timeout)
            .field("allowed_origins", &self.allowed_origins)
            .field("tls", &self.tls.is_some())
            .field("media", &self.media)
            .finish()
    }
}

/// A bound, not yet running lane server. `addrs` are the real addresses (port 0 resolved);
/// await or spawn `server` to run it; `server.handle()` stops it.
pub struct LaneServer {
    pub lane: String,
    pub addrs: Vec<SocketAddr>,
    pub server: Server,
}

impl LaneServer {
    /// The first bound port (what a lane configured with port 0 actually got).
    pub fn port(&self) -> u16 {
        self.addrs.first().map_or(0, SocketAddr::port)
    }
}

/// Bind one lane's port and build its server. Binding happens now, so a port conflict is
/// reported here (naming the lane) rather than when the server starts.
pub fn bind_lane(
    engine: Arc<dyn InferenceEngine>,
    lane: LaneConfig,
    host: &str,
    opts: ApiOptions,
) -> std::io::Result<LaneServer> {
    bind_with(Shared::new(engine, opts), lane, host)
}

/// [`bind_lane`] without the address information.
pub fn build_lane_server(
    engine: Arc<dyn InferenceEngine>,
    lane: LaneConfig,
    host: &str,
    opts: ApiOptions,
) -> std::io::Result<Server> {
    Ok(bind_lane(engine, lane, host, opts)?.server)
}

/// Bind every lane of `config` on `config.host` (all or nothing), sharing one set of compiled
/// model assets.
pub fn bind_all(
    engine: Arc<dyn InferenceEngine>,
    config: &EngineConfig,
    opts: ApiOptions,
) -> std::io::Result<Vec<LaneServer>> {
    let shared = Shared::new(engine, opts);
    config.lanes.iter().map(|lane| bind_with(shared.clone(), lane.clone(), &config.host)).collect()
}

/// Bind and run every lane server until all of them stop (or one fails). Signals do not stop
/// them (the servers leave them to their owner); `shelfserve serve` drains on SIGTERM/SIGINT.
pub async fn serve_all(
    engine: Arc<dyn InferenceEngine>,
    config: &EngineConfig,
    opts: ApiOptions,
) -> std::io::Result<()> {
    let servers = bind_all(engine, config, opts)?;
    futures_util::future::try_join_all(servers.into_iter().map(|s| s.server)).await?;
    Ok(())
}

fn bind_with(shared: Arc<Shared>, lane: LaneConfig, host: &str) -> std::io::Result<LaneServer> {
    metrics::describe();
    let workers = shared.opts.workers;
    let header_timeout = shared.opts.header_read_timeout;
    let tls = shared.opts.tls.clone();
    let name = lane.name.clone();
    let port = lane.port;
    let state = web::Data::new(LaneState { shared, lane });
    // A client that closes its socket must make actix drop the handler future at once (that
    // drops the engine receivers, i.e. cancels); with half-closure allowed actix would keep
    // generating for a reader that is gone.
    // Signals are the binary's (`cli/serve.rs`: drained shutdown), not actix's own stop.
    // Streamed tokens are small writes: with Nagle each would wait for the ACK of the one
    // before (up to 40 ms under delayed ACKs), which is most of a voice turn's latency budget.
    let mut server = HttpServer::new(move || app(state.clone()))
        .tcp_nodelay(true)
        .h1_allow_half_closed(false)
        .client_request_timeout(header_timeout)
        .disable_signals();
    if workers > 0 {
        server = server.workers(workers);
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    let bound = match tls {
        Some(config) => server.bind_rustls_0_23((host, port), (*config).clone()),
        None => server.bind((host, port)),
    };
    let server = bound
        .map_err(|e| std::io::Error::new(e.kind(), format!("lane `{name}`: cannot listen on {host}:{port}: {e}")))?;
    let addrs = server.addrs();
    for a in &addrs {
        tracing::info!(lane = %name, "serving the OpenAI API on {scheme}://{a}/v1");
    }
    Ok(LaneServer { lane: name, addrs, server: server.run() })
}

fn app(
    state: web::Data<LaneState>,
) -> App<
    impl ServiceFactory<
        ServiceRequest,
        Config = (),
        Response = ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
        InitError = (),
    >,
> {
    let lane = state.lane.name.clone();
    let auth = state.shared.opts.auth.clone();
    let origins = state.shared.opts.allowed_origins.clone();
    let cors_on = !origins.is_empty();
    App::new()
        .app_data(state)
        .wrap_fn(move |req: ServiceRequest, srv| {
            use actix_web::dev::Service as _;
            let lane = lane.clone();
            let denied = !auth.admits(req.path(), req.request());
            let fut = if denied {
                let refusal = if anthropic::is_anthropic_path(req.path()) {
                    anthropic::error_response(&ApiError::Unauthorized)
                } else {
                    ApiError::Unauthorized.error_response()
                };
                Either::Left(futures_util::future::ready(Ok(req.into_response(refusal))))
            } else {
                Either::Right(srv.call(req))
            };
            async move {
                let res = fut.await?;
                let route = res.request().match_pattern().unwrap_or_else(|| "unmatched".into());
                metrics::http_request(&lane, &route, res.status().as_u16());
                Ok(res)
            }
        })
        // Outermost, so a browser's preflight (which carries no key) is answered before auth.
        .wrap(Condition::new(cors_on, cors(&origins)))
        .service(resource("/v1/chat/completions", &[Method::POST]).route(web::post().to(chat::handle)))
        .service(resource("/v1/completions", &[Method::POST]).route(web::post().to(completions::handle)))
        .service(resource("/v1/messages", &[Method::POST]).route(web::post().to(anthropic::messages)))
        .service(resource("/v1/messages/count_tokens", &[Method::POST]).route(web::post().to(anthropic::count_tokens)))
        .service(resource("/tokenize", &[Method::POST]).route(web::post().to(tokenize::tokenize)))
        .service(resource("/detokenize", &[Method::POST]).route(web::post().to(tokenize::detokenize)))
        .service(resource("/v1/models", &[Method::GET]).route(web::get().to(list_models)))
        .service(resource("/v1/models/{id}", &[Method::GET]).route(web::get().to(get_model)))
        .service(resource("/health", &[Method::GET]).route(web::get().to(health)))
        .service(resource("/metrics", &[Method::GET]).route(web::get().to(render_metrics)))
        .default_service(web::to(not_found))
}

/// CORS for the configured origins only: preflights from them are answered (any route, the
/// API's methods and headers); other origins get no CORS headers, so browsers refuse them.
fn cors(origins: &[String]) -> Cors {
    let allowed: Vec<String> = origins.to_vec();
    Cors::default()
        .allowed_origin_fn(move |origin, _| origin.to_str().is_ok_and(|o| allowed.iter().any(|a| a == o)))
        .allowed_methods([Method::GET, Method::POST])
        .allowed_headers([header::AUTHORIZATION, header::CONTENT_TYPE, header::ACCEPT])
        .max_age(600)
        .block_on_origin_mismatch(false)
}

/// A route whose other methods get 405 with an `Allow` header naming the ones it has.
fn resource(path: &str, methods: &'static [Method]) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move |req: HttpRequest| async move {
        ApiError::MethodNotAllowed { method: req.method().to_string(), path: req.path().to_owned(), allow: methods }
            .error_response()
    }))
}

/// Per-model assets, built on the first generation request (the model may still be loading
/// when the servers bind, and the chat template compiles in the blocking pool).
pub(crate) struct ModelAssets {
    pub tokenizer: Option<Arc<TokenizerBundle>>,
    pub template: TemplateState,
    /// Encodes rendered conversations so that only template markup becomes control tokens.
    pub chat_encoder: Option<ChatEncoder>,
    pub pieces: Option<Arc<TokenPieces>>,
}

pub(crate) enum TemplateState {
    Ready(Arc<ChatTemplate>),
    Missing,
    Broken(String),
}

/// State shared by all lane servers of one engine.
pub(crate) struct Shared {
    pub engine: Arc<dyn InferenceEngine>,
    pub opts: ApiOptions,
    /// Unix time the servers were built (`created` of the model card).
    pub created: u64,
    assets: OnceLock<ModelAssets>,
    /// Structured outputs' grammar compiler over the model's vocabulary, built on first use.
    grammar: OnceLock<Result<Arc<crate::structured::GrammarCompiler>, String>>,
}

impl Shared {
    fn new(engine: Arc<dyn InferenceEngine>, opts: ApiOptions) -> Arc<Self> {
        Arc::new(Self { engine, opts, created: unix_now(), assets: OnceLock::new(), grammar: OnceLock::new() })
    }

    /// The grammar compiler (blocking on first use: it walks the vocabulary), or why this
    /// model cannot have one (no tokenizer, a vocabulary llguidance cannot read).
    pub fn grammar_compiler(&self) -> Result<Arc<crate::structured::GrammarCompiler>, String> {
        self.grammar
            .get_or_init(|| {
                let tokenizer = self.assets().tokenizer.clone().ok_or("this model has no tokenizer")?;
                crate::structured::GrammarCompiler::new(tokenizer).map(Arc::new).map_err(|e| e.to_string())
            })
            .clone()
    }

    /// Blocking on first use (compiles the chat template): call from the blocking pool, and
    /// only once the engine is ready.
    pub fn assets(&self) -> &ModelAssets {
        self.assets.get_or_init(|| {
            let tokenizer = self.engine.model().tokenizer.clone();
            let template = match tokenizer.as_deref() {
                Some(tok) => match tok.chat_template.as_deref() {
                    Some(src) => match ChatTemplate::new(src, tok.bos_token.as_deref(), tok.eos_token.as_deref()) {
                        Ok(t) => TemplateState::Ready(Arc::new(t)),
                        Err(e) => {
                            tracing::error!("the model's chat template does not compile: {e}");
                            TemplateState::Broken(e.to_string())
                        }
                    },
                    None => TemplateState::Missing,
                },
                None => TemplateState::Missing,
            };
            let pieces = tokenizer.clone().map(|t| Arc::new(TokenPieces::new(t)));
            let chat_encoder = tokenizer.as_deref().and_then(|t| match ChatEncoder::new(t) {
                Ok(e) => Some(e),
                Err(e) => {
                    tracing::error!("cannot build the chat encoder: {e}");
                    None
                }
            });
            ModelAssets { tokenizer, template, chat_encoder, pieces }
        })
    }
}

/// What a lane server's handlers see.
pub(crate) struct LaneState {
    pub shared: Arc<Shared>,
    pub lane: LaneConfig,
}

impl LaneState {
    pub fn ensure_ready(&self) -> Result<(), ApiError> {
        self.shared.engine.readiness().map_err(|e| ApiError::engine(e, None))
    }

    /// Submit every request or none: if one is refused, the receivers already obtained are
    /// dropped (cancelling those requests) and the refusal is returned.
    pub fn submit(&self, requests: Vec<GenerationRequest>, param: &'static str) -> Result<Vec<EventStream>, ApiError> {
        let mut streams = Vec::with_capacity(requests.len());
        for req in requests {
            let prompt_len = req.prompt.len();
            match self.shared.engine.submit(req) {
                Ok(rx) => {
                    metrics::prompt_tokens(&self.lane.name, prompt_len);
                    streams.push(rx);
                }
                Err(e) => {
                    metrics::request_error(&self.lane.name, e.kind());
                    return Err(ApiError::engine(e, Some(param)));
                }
            }
        }
        Ok(streams)
    }

    pub fn served_name(&self) -> &str {
        &self.shared.opts.served_model_name
    }
}

/// Read a JSON body: `Content-Type: application/json` required (415 otherwise, before any byte
/// is read: a browser page may POST `text/plain` cross-origin without a preflight, never JSON),
/// at most `limit` bytes (413, refused before buffering), all of it within the body-read
/// timeout (408).
pub(crate) async fn read_body(req: &HttpRequest, payload: web::Payload, limit: usize) -> Result<Bytes, ApiError> {
    require_json(req)?;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let timeout = req
        .app_data::<web::Data<LaneState>>()
        .map_or(ApiOptions::DEFAULT_BODY_READ_TIMEOUT, |s| s.shared.opts.body_read_timeout);
    match actix_web::rt::time::timeout(timeout, collect_body(payload, declared, limit)).await {
        Ok(body) => body,
        Err(_) => Err(ApiError::BodyTimeout { secs: timeout.as_secs_f64() }),
    }
}

async fn collect_body(mut payload: web::Payload, declared: Option<u64>, limit: usize) -> Result<Bytes, ApiError> {
    let mut buf = BytesMut::with_capacity(declared.map_or(0, |d| d as usize));
    while let Some(chunk) = payload.next().await {
        let chunk = chunk.map_err(|e| ApiError::MalformedBody(format!("could not read the request body: {e}")))?;
        if buf.len() + chunk.len() > limit {
            return Err(ApiError::PayloadTooLarge { limit });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(buf.freeze())
}

/// `application/json`, parameters (charset) allowed; anything else, or none, is 415.
fn require_json(req: &HttpRequest) -> Result<(), ApiError> {
    let sent = req.headers().get(header::CONTENT_TYPE).map(|v| v.to_str().unwrap_or("(not text)").to_owned());
    let is_json = sent.as_deref().is_some_and(|ct| {
        ct.split(';').next().is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
    });
    if is_json {
        Ok(())
    } else {
        Err(ApiError::UnsupportedMediaType { sent })
    }
}

/// Run `f` on the blocking pool (tokenization, template rendering, JSON parsing of big bodies).
pub(crate) async fn blocking<R: Send + 'static>(
    f: impl FnOnce() -> Result<R, ApiError> + Send + 'static,
) -> Result<R, ApiError> {
    web::block(f).await.map_err(|_| ApiError::Internal("the blocking thread pool is shutting down".into()))?
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// A fresh response id such as `chatcmpl-3f2a…`.
pub(crate) fn response_id(prefix: &str) -> String {
    format!("{prefix}-{:032x}", rand::random::<u128>())
}

async fn health(state: web::Data<LaneState>) -> Result<HttpResponse, ApiError> {
    state.ensure_ready()?;
    Ok(HttpResponse::Ok().json(serde_json::json!({"status": "ok"})))
}

fn model_card(state: &LaneState) -> types::ModelCard<'_> {
    let model = state.shared.engine.model();
    types::ModelCard {
        id: state.served_name(),
        object: "model",
        created: state.shared.created,
        owned_by: "shelfserve",
        root: &model.id,
        max_model_len: model.max_context,
    }
}

async fn list_models(state: web::Data<LaneState>) -> HttpResponse {
    HttpResponse::Ok().json(types::ModelList { object: "list", data: vec![model_card(&state)] })
}

async fn get_model(state: web::Data<LaneState>, id: web::Path<String>) -> Result<HttpResponse, ApiError> {
    params::check_model(Some(id.as_str()), state.served_name(), state.shared.engine.model())?;
    Ok(HttpResponse::Ok().json(model_card(&state)))
}

async fn render_metrics(state: web::Data<LaneState>) -> HttpResponse {
    let text = state.shared.opts.metrics.as_ref().map(|render| render()).unwrap_or_default();
    HttpResponse::Ok().content_type("text/plain; version=0.0.4; charset=utf-8").body(text)
}

async fn not_found(req: HttpRequest) -> HttpResponse {
    ApiError::RouteNotFound { method: req.method().to_string(), path: req.path().to_owned() }.error_response()
}
