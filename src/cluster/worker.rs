//! `shelfserve worker`: one tensor-parallel rank in its own process. It joins the head's node,
//! asks the head for its rank (`head::join`), loads that rank's shard of the same model, and runs
//! an `ExecutorActor` whose scheduler is the head's (a remote actor): the head sends it steps as
//! to any executor. It exits when the head's node goes away.

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorRef};
use ractor_cluster::node::NodeServerSessionInformation;
use ractor_cluster::{NodeEventSubscription, NodeServerMessage};

use super::{ClusterComm, ClusterError};
use crate::actors::executor::{ExecutorActor, ExecutorArgs};
use crate::actors::scheduler::SchedulerMsg;
use crate::backend::cpu::{CpuBackend, CpuOptions, TpShard};
use crate::backend::{Backend, BackendError, KvGeometry};
use crate::generate::BackendMaker;
use crate::model::ModelBundle;

/// A CPU rank's backend joined to the cluster's group by `comm`: loads rank `comm.rank()`'s
/// shard, then waits up to `join_wait` for every other rank's collective actor.
pub fn cpu_rank_maker(
    bundle: Arc<ModelBundle>,
    kv: KvGeometry,
    threads: usize,
    comm: ClusterComm,
    join_wait: Duration,
) -> BackendMaker {
    use crate::parallel::Collective;
    Box::new(move || {
        let unavailable = |reason: String| BackendError::Unavailable { device: "cluster".into(), reason };
        let rank =
            crate::parallel::TpRank::new(comm.rank(), comm.world_size()).map_err(|e| unavailable(e.to_string()))?;
        let opts = CpuOptions { threads, kv, kv_precision: None };
        let world = comm.world_size();
        comm.connect(join_wait).map_err(|e| unavailable(e.to_string()))?;
        let shard = TpShard { rank, comm: Arc::new(comm) };
        let b = CpuBackend::new_shard(&bundle.config, bundle.weights.as_ref(), opts, Some(shard))?;
        tracing::info!(
            rank = rank.rank,
            world,
            weights_mib = b.weight_bytes() / (1 << 20),
            threads = b.threads(),
            "tensor-parallel rank loaded on cpu, its group across processes"
        );
        Ok(Box::new(b) as Box<dyn Backend>)
    })
}

/// What `shelfserve worker` was told.
pub struct WorkerOptions {
    pub head_addr: String,
    pub rank: usize,
    pub cookie: String,
    /// This node server's port (0 = any free port).
    pub port: u16,
    /// The host name or address other workers reach this one at (default: this host's name).
    pub advertise_host: Option<String>,
    /// CPU threads of this rank (0 = every core of this host).
    pub threads: usize,
    /// How long to keep trying to reach the head and for the other ranks to join.
    pub join_wait: Duration,
    /// TLS for this node's sessions (the head's must be on too).
    pub tls: Option<super::NodeTls>,
}

/// Runs worker `opts.rank` of `bundle` until the head disconnects (an error: the group is gone)
/// or the process is told to stop.
pub async fn run_worker(bundle: ModelBundle, opts: WorkerOptions) -> Result<(), ClusterError> {
    // A port of our own choice when none is given: the other workers are told it.
    let port = match opts.port {
        0 => std::net::TcpListener::bind("0.0.0.0:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| ClusterError::Node(format!("finding a free port: {e}")))?
            .port(),
        p => p,
    };
    let host = opts.advertise_host.clone().unwrap_or_else(super::host_name);
    let node = super::start_node(
        None,
        port,
        &opts.cookie,
        &super::worker_node_name(opts.rank),
        Some(host.as_str()),
        opts.tls.as_ref(),
    )
    .await?;
    let (closed_tx, mut closed) = tokio::sync::mpsc::unbounded_channel();
    node.cast(NodeServerMessage::SubscribeToEvents {
        id: "shelfserve-worker".into(),
        subscription: Box::new(SessionWatch { closed: closed_tx }),
    })
    .map_err(|e| ClusterError::Node(e.to_string()))?;
    connect_with_retry(&node, &opts.head_addr, opts.tls.as_ref(), opts.join_wait).await?;
    let fingerprint = crate::actors::engine::model_fingerprint(&bundle);
    let joining = async {
        let (head, assignment) =
            super::head::join(opts.rank, fingerprint, format!("{host}:{port}"), opts.join_wait).await?;
        // One session per pair of nodes: this rank connects to the ranks below it.
        for addr in super::head::lower_peers(&head, opts.rank, opts.join_wait).await? {
            connect_with_retry(&node, &addr, opts.tls.as_ref(), opts.join_wait).await?;
        }
        let scheduler: ActorRef<SchedulerMsg> =
            super::wait_for_member(&super::scheduler_group(&assignment.group), opts.join_wait).await?.into();
        Ok::<_, ClusterError>((assignment, scheduler))
    };
    // A refused cookie closes the session before anything is synchronised.
    let (assignment, scheduler) = tokio::select! {
        joined = joining => joined?,
        Some((name, addr)) = closed.recv() => {
            let who = if super::rank_of_node(&name).is_some() { "a worker" } else { "the head" };
            return Err(ClusterError::Node(format!("{who} ({addr}) closed the connection (is the cookie the head's?)")))
        }
    };
    tracing::info!(rank = opts.rank, world = assignment.world, group = %assignment.group, "worker: joined the head");
    let comm = ClusterComm::start(&assignment.group, opts.rank, assignment.world, assignment.collective_timeout)
        .await
        .map_err(|e| ClusterError::Node(e.to_string()))?;
    let collective = comm.actor();
    let threads =
        if opts.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { opts.threads };
    let bundle = Arc::new(bundle);
    let make = if super::glm5_rank::is_glm5(&bundle) {
        // The head checked the split before it took any join; the shard plan is checked again
        // at load (a different checkpoint would already have been refused by its fingerprint).
        let ep = assignment.expert_parallel;
        super::glm5_rank::glm5_rank_maker(bundle, assignment.kv, threads, comm, opts.join_wait, ep)
    } else {
        cpu_rank_maker(bundle, assignment.kv, threads, comm, opts.join_wait)
    };
    let (executor, _) = Actor::spawn(
        None,
        ExecutorActor,
        ExecutorArgs {
            make_backend: Box::new(move || make().map_err(|e| e.to_string())),
            scheduler,
            rank: opts.rank,
            workspace_probe: None,
            group: Some(assignment.group.clone()),
        },
    )
    .await
    .map_err(|e| ClusterError::Node(format!("starting the executor: {e}")))?;
    let mut signals = shutdown_signals().map_err(|e| ClusterError::Node(e.to_string()))?;
    let result = loop {
        tokio::select! {
            Some((name, addr)) = closed.recv() => match super::rank_of_node(&name) {
                // Another worker is gone: stop waiting for it (the head fails the group).
                Some(rank) => {
                    let why = format!("its node ({addr}) disconnected");
                    let _ = collective.cast(super::collective::CollectiveMsg::Abort(rank as u64, why));
                }
                None => break Err(ClusterError::Node(format!("the head ({addr}) disconnected; this rank's group is gone"))),
            },
            Some(()) = signals.recv() => break Ok(()),
        }
    };
    executor.stop(None);
    node.stop(None);
    result
}

/// The head may start after the worker: keep trying until `wait` is up.
async fn connect_with_retry(
    node: &ActorRef<NodeServerMessage>,
    addr: &str,
    tls: Option<&super::NodeTls>,
    wait: Duration,
) -> Result<(), ClusterError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match super::connect(node, addr, tls).await {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(ClusterError::Timeout(format!("could not reach {addr} within {wait:?}: {e}")))
            }
            Err(e) => tracing::debug!(addr, error = %e, "worker: the head is not reachable yet"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn shutdown_signals() -> std::io::Result<tokio::sync::mpsc::UnboundedReceiver<()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        let _ = tx.send(());
    });
    Ok(rx)
}

/// Tells the worker which node's session closed: (peer name, peer address).
struct SessionWatch {
    closed: tokio::sync::mpsc::UnboundedSender<(String, String)>,
}

impl NodeEventSubscription for SessionWatch {
    fn node_session_opened(&self, _: NodeServerSessionInformation) {}

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        let name = ses.peer_name.map(|n| n.name).unwrap_or_default();
        let _ = self.closed.send((name, ses.peer_addr));
    }

    fn node_session_authenticated(&self, _: NodeServerSessionInformation) {}
}
