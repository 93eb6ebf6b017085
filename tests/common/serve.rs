//! The real HTTP layer in front of an in-process engine, for the end-to-end tests: every lane on
//! a free port of 127.0.0.1, servers running on the test's runtime, stopped on request. Knows
//! nothing of the client (`e2e_http`); tests build their clients from the lane addresses.

use std::net::SocketAddr;
use std::sync::Arc;

use actix_web::dev::ServerHandle;
use shelfserve::actors::{Engine, InferenceEngine};
use shelfserve::api::{bind_all, ApiOptions};
use shelfserve::config::engine::EngineConfig;

/// `cfg` with the host 127.0.0.1 and every lane on a port the OS chooses.
pub fn on_free_ports(mut cfg: EngineConfig) -> EngineConfig {
    cfg.host = "127.0.0.1".into();
    for lane in &mut cfg.lanes {
        lane.port = 0;
    }
    cfg
}

/// Every lane of a configuration bound and served (two HTTP workers each).
pub struct Lanes {
    addrs: Vec<(String, SocketAddr)>,
    servers: Vec<ServerHandle>,
}

impl Lanes {
    /// Binds every lane of `cfg` (ports chosen by the OS) and spawns its server on the current
    /// runtime. The servers answer at once, before the model is loaded.
    pub fn serve(engine: &Arc<Engine>, cfg: &EngineConfig, served_model_name: &str) -> Lanes {
        let mut opts = ApiOptions::new(served_model_name);
        opts.workers = 2;
        let dyn_engine: Arc<dyn InferenceEngine> = engine.clone();
        let bound = bind_all(dyn_engine, cfg, opts).expect("bind the lanes on free ports");
        let addrs = bound.iter().map(|s| (s.lane.clone(), s.addrs[0])).collect();
        let servers = bound.iter().map(|s| s.server.handle()).collect();
        for s in bound {
            assert_ne!(s.port(), 0, "port 0 resolves to the real port");
            tokio::spawn(s.server);
        }
        Lanes { addrs, servers }
    }

    /// The address lane `name` listens on.
    pub fn addr(&self, name: &str) -> SocketAddr {
        self.addrs.iter().find(|(lane, _)| lane == name).map(|&(_, a)| a).unwrap_or_else(|| panic!("no lane {name}"))
    }

    /// Stops every server (in-flight requests are dropped).
    pub async fn stop(&self) {
        for h in &self.servers {
            h.stop(false).await;
        }
    }
}

/// Runs blocking client code off the async runtime.
pub async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    tokio::task::spawn_blocking(f).await.expect("client thread panicked")
}
