//! The OpenAI-compatible HTTP API (actix-web): one server per lane port, speaking only to the
//! engine boundary ([`InferenceEngine`]: submit, receive a stream, drop it to cancel).
//!
//! Owns: server construction and binding, routing, the API-key gate (`auth`: deny by default on
//! the normalized path, before the body is read), request-body limits,
//! `/health`, `/v1/models`, `/metrics`, and (in the submodules) request validation, prompt
//! rendering and tokenization (on the blocking pool, never on the async runtime), response and
//! SSE formatting, and the single error → HTTP mapping (`errors`). It holds no engine state: a
//! request's only link to the engine is its [`EventStream`]s, owned by the handler future or the
//! response body, so a client that disconnects drops them and the engine cancels the request.
//!
//! Connections are served with HTTP/1 half-closure disabled: a client that closes its socket
//! makes actix drop the handler future at once, which is what cancels a non-streaming request.

pub mod auth;
mod chat;
mod completions;
pub mod errors;
pub mod metrics;
pub mod params;
mod sse;
mod tokens;
pub mod types;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::body::MessageBody;
use actix_web::dev::{Server, ServiceFactory, ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer, ResponseError};
use bytes::{Bytes, BytesMut};
use futures_util::future::Either;
use futures_util::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;

use crate::actors::handle::{EngineError, EventStream, GenerationRequest, InferenceEngine};
use crate::config::engine::{EngineConfig, LaneConfig};
use crate::tokenizer::chat::ChatTemplate;
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
}

impl ApiOptions {
    /// Room for a 1M-token prompt sent as a JSON list of ids.
    pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

    pub fn new(served_model_name: impl Into<String>) -> Self {
        Self {
            auth: auth::AuthPolicy::default(),
            served_model_name: served_model_name.into(),
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            metrics: None,
            workers: 0,
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
    let name = lane.name.clone();
    let port = lane.port;
    let state = web::Data::new(LaneState { shared, lane });
    // A client that closes its socket must make actix drop the handler future at once (that
    // drops the engine receivers, i.e. cancels); with half-closure allowed actix would keep
    // generating for a reader that is gone.
    // Signals are the binary's (`cli/serve.rs`: drained shutdown), not actix's own stop.
    let mut server = HttpServer::new(move || app(state.clone())).h1_allow_half_closed(false).disable_signals();
    if workers > 0 {
        server = server.workers(workers);
    }
    let server = server
        .bind((host, port))
        .map_err(|e| std::io::Error::new(e.kind(), format!("lane `{name}`: cannot listen on {host}:{port}: {e}")))?;
    let addrs = server.addrs();
    for a in &addrs {
        tracing::info!(lane = %name, "serving the OpenAI API on http://{a}/v1");
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
    App::new()
        .app_data(state)
        .wrap_fn(move |req: ServiceRequest, srv| {
            use actix_web::dev::Service as _;
            let lane = lane.clone();
            let denied = !auth.admits(req.path(), req.request());
            let fut = if denied {
                Either::Left(futures_util::future::ready(
                    Ok(req.into_response(ApiError::Unauthorized.error_response())),
                ))
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
        .service(resource("/v1/chat/completions").route(web::post().to(chat::handle)))
        .service(resource("/v1/completions").route(web::post().to(completions::handle)))
        .service(resource("/v1/models").route(web::get().to(list_models)))
        .service(resource("/v1/models/{id}").route(web::get().to(get_model)))
        .service(resource("/health").route(web::get().to(health)))
        .service(resource("/metrics").route(web::get().to(render_metrics)))
        .default_service(web::to(not_found))
}

fn resource(path: &str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(method_not_allowed))
}

/// Per-model assets, built on the first generation request (the model may still be loading
/// when the servers bind, and the chat template compiles in the blocking pool).
pub(crate) struct ModelAssets {
    pub tokenizer: Option<Arc<TokenizerBundle>>,
    pub template: TemplateState,
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
}

impl Shared {
    fn new(engine: Arc<dyn InferenceEngine>, opts: ApiOptions) -> Arc<Self> {
        Arc::new(Self { engine, opts, created: unix_now(), assets: OnceLock::new() })
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
            ModelAssets { tokenizer, template, pieces }
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
        if self.shared.engine.is_draining() {
            Err(ApiError::engine(EngineError::ShuttingDown, None))
        } else if self.shared.engine.is_ready() {
            Ok(())
        } else {
            Err(ApiError::engine(EngineError::NotReady("the model is still loading".into()), None))
        }
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

/// Read the body, refusing more than `limit` bytes (413) before buffering them.
pub(crate) async fn read_body(req: &HttpRequest, mut payload: web::Payload, limit: usize) -> Result<Bytes, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
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

async fn method_not_allowed(req: HttpRequest) -> HttpResponse {
    ApiError::MethodNotAllowed { method: req.method().to_string(), path: req.path().to_owned() }.error_response()
}
