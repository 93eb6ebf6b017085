//! The cluster's flags: `serve --head` (this process owns rank 0, the scheduler and the API) and
//! `shelfserve worker` (one more rank in its own process, on this or another host).

use std::time::Duration;

use clap::Args;

use super::{CliError, ModelArgs};
use crate::cluster::head::HeadOptions;
use crate::cluster::worker::{run_worker, WorkerOptions};

/// `serve --head`: ranks 1.. of `--tensor-parallel-size` are `shelfserve worker` processes.
#[derive(Args, Debug, Clone)]
pub struct HeadArgs {
    /// Serve as the head of a tensor-parallel group whose ranks 1.. are `shelfserve worker`
    /// processes (this or other hosts, the same model files on each); this process runs rank 0,
    /// the scheduler and the API, and waits for every rank before serving. CPU ranks of
    /// llama-family models.
    #[arg(long, env = "SHELFSERVE_HEAD")]
    pub head: bool,
    /// Where the head's cluster node listens for workers.
    #[arg(long, env = "SHELFSERVE_CLUSTER_ADDR", default_value = "0.0.0.0:7450", value_name = "HOST:PORT")]
    pub cluster_addr: String,
    /// The secret every node of the cluster presents (ractor_cluster's cookie authentication).
    /// Without the --cluster-tls-* flags node traffic is not encrypted: keep it on a trusted network.
    #[arg(long, env = "SHELFSERVE_CLUSTER_COOKIE", value_name = "SECRET")]
    pub cluster_cookie: Option<String>,
    /// Seconds to wait for every worker to join before the engine fails.
    #[arg(long, env = "SHELFSERVE_CLUSTER_JOIN_TIMEOUT", default_value_t = 300.0, value_name = "SECONDS")]
    pub cluster_join_timeout: f64,
    /// Seconds a rank waits for another in a collective before declaring it failed (a dead
    /// worker's node is noticed at once regardless).
    #[arg(long, env = "SHELFSERVE_CLUSTER_TIMEOUT", default_value_t = crate::cluster::DEFAULT_COLLECTIVE_TIMEOUT.as_secs_f64(), value_name = "SECONDS")]
    pub cluster_timeout: f64,
    #[command(flatten)]
    pub tls: ClusterTlsArgs,
}

/// TLS between the cluster's nodes (head and workers alike).
#[derive(Args, Debug, Clone)]
pub struct ClusterTlsArgs {
    /// TLS between cluster nodes: this node's PEM certificate chain, valid for the host it is
    /// reached at (needs --cluster-tls-key and --cluster-tls-ca; every node of the cluster must
    /// use TLS).
    #[arg(long, env = "SHELFSERVE_CLUSTER_TLS_CERT", requires_all = ["cluster_tls_key", "cluster_tls_ca"])]
    pub cluster_tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --cluster-tls-cert.
    #[arg(long, env = "SHELFSERVE_CLUSTER_TLS_KEY", requires = "cluster_tls_cert")]
    pub cluster_tls_key: Option<std::path::PathBuf>,
    /// The PEM certificates this node trusts for the nodes it connects to.
    #[arg(long, env = "SHELFSERVE_CLUSTER_TLS_CA", requires = "cluster_tls_cert")]
    pub cluster_tls_ca: Option<std::path::PathBuf>,
}

impl ClusterTlsArgs {
    fn load(&self) -> Result<Option<crate::cluster::NodeTls>, CliError> {
        match (&self.cluster_tls_cert, &self.cluster_tls_key, &self.cluster_tls_ca) {
            (Some(cert), Some(key), Some(ca)) => {
                crate::cluster::NodeTls::from_files(cert, key, ca).map(Some).map_err(|e| CliError::Usage(e.to_string()))
            }
            _ => Ok(None),
        }
    }
}

impl HeadArgs {
    /// Starts the head's node server (in the runtime) when `--head` is given.
    pub async fn start(&self) -> Result<Option<HeadOptions>, CliError> {
        if !self.head {
            return Ok(None);
        }
        let cookie = self
            .cluster_cookie
            .clone()
            .ok_or_else(|| CliError::Usage("--head needs --cluster-cookie (or SHELFSERVE_CLUSTER_COOKIE)".into()))?;
        let addr: std::net::SocketAddr = self
            .cluster_addr
            .parse()
            .map_err(|e| CliError::Usage(format!("--cluster-addr `{}`: {e}", self.cluster_addr)))?;
        let tls = self.tls.load()?;
        let node =
            crate::cluster::start_node(Some(addr.ip()), addr.port(), &cookie, "shelfserve-head", None, tls.as_ref())
                .await
                .map_err(|e| CliError::Usage(e.to_string()))?;
        tracing::info!(addr = %addr, "head: cluster node listening for workers");
        Ok(Some(HeadOptions {
            node,
            join_wait: seconds(self.cluster_join_timeout, "--cluster-join-timeout")?,
            collective_timeout: seconds(self.cluster_timeout, "--cluster-timeout")?,
        }))
    }
}

fn seconds(s: f64, flag: &str) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| CliError::Usage(format!("{flag} must be a positive number of seconds, not {s}")))
}

/// `shelfserve worker`: one rank of a head's tensor-parallel group.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The same model as the head's, from this host's files (`--model` with the same path or
    /// name on every host; the head refuses a worker whose weights differ). `--threads` is this
    /// rank's (0 = every core of this host).
    #[command(flatten)]
    pub model: ModelArgs,
    /// The head's cluster address (`serve --head --cluster-addr`).
    #[arg(long, env = "SHELFSERVE_HEAD_ADDR", value_name = "HOST:PORT")]
    pub head_addr: String,
    /// This worker's rank, 1 .. tensor-parallel size - 1 (the head runs rank 0).
    #[arg(long, env = "SHELFSERVE_RANK")]
    pub rank: usize,
    /// The head's `--cluster-cookie`.
    #[arg(long, env = "SHELFSERVE_CLUSTER_COOKIE", value_name = "SECRET")]
    pub cookie: String,
    /// This worker's node port (0 = any free port); the other workers connect to it.
    #[arg(long, env = "SHELFSERVE_WORKER_PORT", default_value_t = 0)]
    pub port: u16,
    /// The host name or address the other workers reach this one at [default: this host's name].
    #[arg(long, env = "SHELFSERVE_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Seconds to keep trying to reach the head, and to wait for the other ranks.
    #[arg(long, env = "SHELFSERVE_CLUSTER_JOIN_TIMEOUT", default_value_t = 300.0, value_name = "SECONDS")]
    pub join_timeout: f64,
    #[command(flatten)]
    pub tls: ClusterTlsArgs,
}

pub fn run_worker_cmd(args: &WorkerArgs) -> Result<(), CliError> {
    if args.model.device_selection()?.resolve().kind != crate::generate::ResolvedKind::Cpu {
        return Err(CliError::Usage("a worker runs a CPU rank (--device cpu) so far".into()));
    }
    let bundle = args.model.open()?;
    let opts = WorkerOptions {
        head_addr: args.head_addr.clone(),
        rank: args.rank,
        cookie: args.cookie.clone(),
        port: args.port,
        advertise_host: args.advertise_host.clone(),
        threads: args.model.threads,
        join_wait: seconds(args.join_timeout, "--join-timeout")?,
        tls: args.tls.load()?,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(run_worker(bundle, opts)).map_err(|e| CliError::Usage(e.to_string()))
}
