//! Tensor-parallel ranks in several processes (and hosts) as one actor system, through
//! `ractor_cluster`: every process runs a `NodeServer` (cookie authentication, TLS optional), the
//! workers connect to the head (and to each other), and the actors that must be reached from another process are
//! members of process groups named here. The head's `SchedulerActor` sends steps to a worker's
//! `ExecutorActor` exactly as to its own rank 0 (a remote `ActorRef`, the messages encoded by
//! `wire`), and the ranks' collectives are messages between per-rank actors (`collective`).
//!
//! - `serve --head` ([`head`]): owns rank 0, the scheduler and the HTTP API; answers each worker's
//!   `Join` with the group's shape (world size, KV geometry), and turns a worker's disconnect or
//!   silence into `ExecutorFailed` for that rank (requests fail, `/health` says which rank).
//! - `worker --head-addr HOST:PORT --rank R` ([`worker`]): loads rank R's shard of the same model
//!   and serves steps until the head goes away.

pub mod collective;
pub mod glm5_rank;
pub mod head;
pub mod wire;
pub mod worker;

use std::time::Duration;

use ractor::ActorRef;
use ractor_cluster::{NodeServer, NodeServerMessage};

use crate::actors::executor::ExecutorMsg;

pub use collective::ClusterComm;

/// The process group of the head's `HeadActor` (one head per cluster).
pub const HEAD_GROUP: &str = "shelfserve.head";

/// The largest message a node accepts. A collective part is one rank's activations for a whole
/// step (tokens × hidden size × 4 bytes: 32 MiB for 2048 tokens of a 4096-wide model), above
/// ractor_cluster's default of 16 MiB; nodes authenticate with the cookie before any step runs.
pub const MAX_FRAME_BYTES: u64 = 256 << 20;

/// How long a collective waits for another process's rank before declaring it failed. Longer
/// than any step of a CPU rank in CI; a dead worker's node is noticed at once regardless (its
/// session closes).
pub const DEFAULT_COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// The scheduler's process group: workers send their reports there.
pub fn scheduler_group(group: &str) -> String {
    format!("{group}.scheduler")
}

/// Rank `rank`'s executor.
pub fn executor_group(group: &str, rank: usize) -> String {
    format!("{group}.executor.{rank}")
}

/// Rank `rank`'s collective actor.
pub fn collective_group(group: &str, rank: usize) -> String {
    format!("{group}.collective.{rank}")
}

/// The node name of worker `rank` (sessions are told apart by it).
pub fn worker_node_name(rank: usize) -> String {
    format!("shelfserve-worker-{rank}")
}

/// The rank of a worker from its session's peer name (`shelfserve-worker-R@host`).
pub fn rank_of_node(name: &str) -> Option<usize> {
    name.split('@').next()?.strip_prefix("shelfserve-worker-")?.parse().ok()
}

/// Rank `rank`'s executor as this process sees it (a remote actor for a worker's rank).
pub fn executor_of(group: &str, rank: usize) -> Option<ActorRef<ExecutorMsg>> {
    ractor::pg::get_members(&executor_group(group, rank)).into_iter().next().map(Into::into)
}

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cluster: {0}")]
    Node(String),
    #[error("cluster: the head refused rank {rank}: {reason}")]
    Refused { rank: usize, reason: String },
    #[error("cluster: {0}")]
    Timeout(String),
}

/// TLS between nodes (`--cluster-tls-cert/-key/-ca`): this node's certificate for the sessions it
/// accepts, and the roots it trusts for the sessions it opens (the peer's name is the host of the
/// address it is reached at).
#[derive(Clone)]
pub struct NodeTls {
    server: std::sync::Arc<rustls::ServerConfig>,
    client: std::sync::Arc<rustls::ClientConfig>,
}

impl NodeTls {
    pub fn from_files(
        cert: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
    ) -> Result<Self, ClusterError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::CertificateDer;
        let server = crate::api::tls::server_config(cert, key).map_err(|e| ClusterError::Node(e.to_string()))?;
        let mut roots = rustls::RootCertStore::empty();
        let cas = CertificateDer::pem_file_iter(ca)
            .map_err(|e| ClusterError::Node(format!("{}: {e}", ca.display())))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ClusterError::Node(format!("{}: not a PEM certificate file: {e}", ca.display())))?;
        for c in cas {
            roots.add(c).map_err(|e| ClusterError::Node(format!("{}: {e}", ca.display())))?;
        }
        if roots.is_empty() {
            return Err(ClusterError::Node(format!("{}: no certificate in the file", ca.display())));
        }
        let client =
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| ClusterError::Node(e.to_string()))?
                .with_root_certificates(roots)
                .with_no_client_auth();
        Ok(NodeTls { server, client: std::sync::Arc::new(client) })
    }
}

/// Opens a session from `node` to the node at `addr` (`host:port`), over TLS when `tls` is given.
pub async fn connect(
    node: &ActorRef<NodeServerMessage>,
    addr: &str,
    tls: Option<&NodeTls>,
) -> Result<(), ClusterError> {
    let result = match tls {
        None => ractor_cluster::client_connect(node, addr).await,
        Some(tls) => {
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_matches(|c| c == '[' || c == ']');
            let name = rustls::pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| ClusterError::Node(format!("`{host}` is not a TLS server name: {e}")))?;
            let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::clone(&tls.client));
            ractor_cluster::client_connect_enc(node, addr, connector, name).await
        }
    };
    result.map_err(|e| ClusterError::Node(format!("connecting to {addr}: {e}")))
}

/// Starts this process's node server on `port` (0 = any free port; on `listen`, else every
/// address) under `name`, accepting peers that present `cookie`. Connections are made only where
/// this crate makes them (ractor_cluster's isolated mode): every worker to the head, and each
/// worker to the workers of lower rank at the addresses they gave the head (`head::Peers`), so
/// every pair of nodes has exactly one session (transitive mode opens duplicates and closes one,
/// which would look like a lost rank). `advertise` is the host name this node gives its peers.
pub async fn start_node(
    listen: Option<std::net::IpAddr>,
    port: u16,
    cookie: &str,
    name: &str,
    advertise: Option<&str>,
    tls: Option<&NodeTls>,
) -> Result<ActorRef<NodeServerMessage>, ClusterError> {
    if cookie.is_empty() {
        return Err(ClusterError::Node("an empty cluster cookie would let anyone join: set one".into()));
    }
    let hostname = advertise.map_or_else(host_name, str::to_string);
    let mode = Some(ractor_cluster::node::NodeConnectionMode::Isolated);
    let encryption = tls.map(|t| {
        ractor_cluster::IncomingEncryptionMode::Tls(tokio_rustls::TlsAcceptor::from(std::sync::Arc::clone(&t.server)))
    });
    let mut server = NodeServer::new(port, cookie.to_string(), name.to_string(), hostname, encryption, mode)
        .with_max_inbound_frame_size(MAX_FRAME_BYTES);
    if let Some(ip) = listen {
        server = server.with_listen_addr(ip);
    }
    let (node, _) = ractor::Actor::spawn(None, server, ())
        .await
        .map_err(|e| ClusterError::Node(format!("starting the node server on port {port}: {e}")))?;
    Ok(node)
}

/// This host's name (what other nodes connect to), `localhost` if it has none.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it on success.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    let name = if ok { std::ffi::CStr::from_bytes_until_nul(&buf).ok().and_then(|c| c.to_str().ok()) } else { None };
    name.filter(|n| !n.is_empty()).unwrap_or("localhost").to_string()
}

/// Waits for a process group to have a member (it is synchronised from another node), polling.
pub async fn wait_for_member(group: &str, wait: Duration) -> Result<ractor::ActorCell, ClusterError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Some(cell) = ractor::pg::get_members(&group.to_string()).into_iter().next() {
            return Ok(cell);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ClusterError::Timeout(format!("nothing joined process group `{group}` within {wait:?}")));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_ranks_are_read_back_from_node_names() {
        assert_eq!(rank_of_node(&format!("{}@host-a", worker_node_name(3))), Some(3));
        assert_eq!(rank_of_node("shelfserve-worker-12"), Some(12));
        assert_eq!(rank_of_node("shelfserve-head@h"), None);
        assert_eq!(rank_of_node("shelfserve-worker-x@h"), None);
    }
}
