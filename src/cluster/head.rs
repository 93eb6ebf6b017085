//! The head's side of the cluster (`serve --head`): the `HeadActor` that workers join, and the
//! watcher that turns a worker's lost node session into that rank's failure.
//!
//! The head owns rank 0 (its executor and collective actor are local) and the scheduler, which
//! waits for every rank's `ExecutorReady` as it does for local ranks. A worker asks to `Join` with
//! its rank and its model's fingerprint (the same model on every host); the answer is the group's
//! name and shape, which the worker's rank must match (the KV geometry is the head's).

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::node::NodeServerSessionInformation;
use ractor_cluster::{NodeEventSubscription, NodeServerMessage, RactorClusterMessage};
use serde::{Deserialize, Serialize};

use super::collective::{ClusterComm, CollectiveMsg};
use super::wire::{decode, encode};
use crate::actors::scheduler::SchedulerMsg;
use crate::backend::KvGeometry;

/// A worker's request to take a rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JoinRequest {
    pub rank: usize,
    /// `actors::engine::model_fingerprint` of the worker's model.
    pub fingerprint: String,
    /// `host:port` of the worker's node server: the workers of higher rank connect to it.
    pub address: String,
}

/// The head's answer: what the worker's rank must be.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    /// Names the process groups of this cluster's ranks.
    pub group: String,
    pub world: usize,
    pub kv: KvGeometry,
    pub collective_timeout: Duration,
    /// `--enable-expert-parallel` on the head: every rank must split the experts the same way.
    pub expert_parallel: bool,
}

#[derive(RactorClusterMessage)]
pub enum HeadMsg {
    /// A postcard `JoinRequest`; answered with a postcard `Result<Assignment, String>`.
    #[rpc]
    Join(Vec<u8>, RpcReplyPort<Vec<u8>>),
    /// The node addresses of the worker ranks that joined so far, by rank (postcard
    /// `Vec<Option<String>>`; rank 0 is the head, `None`). The argument is unused.
    #[rpc]
    Peers(u8, RpcReplyPort<Vec<u8>>),
    /// A node session closed: (peer name, peer address). Sent by this process's session watcher.
    NodeDown(String, String),
}

/// What the head needs from the command line.
#[derive(Clone)]
pub struct HeadOptions {
    pub node: ActorRef<NodeServerMessage>,
    /// How long rank 0 waits for every worker to join before the engine fails.
    pub join_wait: Duration,
    pub collective_timeout: Duration,
}

/// The cluster half of a head engine: made before the ranks' backends (rank 0's communicator
/// goes into its backend), attached once the scheduler exists.
pub struct HeadSetup {
    pub group: String,
    pub world: usize,
    expert_parallel: bool,
    opts: HeadOptions,
    collective: ActorRef<CollectiveMsg>,
    /// The scheduler, once spawned: rank 0's communicator reports a silent peer to it.
    scheduler: Arc<OnceLock<ActorRef<SchedulerMsg>>>,
}

impl HeadSetup {
    /// Rank 0's communicator of a group of `world` ranks for the model with `fingerprint`
    /// (`expert_parallel`: the split every worker is told to take).
    pub async fn prepare(
        opts: HeadOptions,
        fingerprint: &str,
        world: usize,
        expert_parallel: bool,
    ) -> Result<(HeadSetup, ClusterComm), super::ClusterError> {
        if world < 2 {
            return Err(super::ClusterError::Node(
                "--head serves a tensor-parallel group across processes: set --tensor-parallel-size to 2 or more"
                    .into(),
            ));
        }
        let group = format!("shelfserve.{}.tp{world}", &fingerprint[..fingerprint.len().min(16)]);
        let scheduler: Arc<OnceLock<ActorRef<SchedulerMsg>>> = Arc::default();
        let report = Arc::clone(&scheduler);
        let comm = ClusterComm::start(&group, 0, world, opts.collective_timeout)
            .await
            .map_err(|e| super::ClusterError::Node(e.to_string()))?
            .on_peer_failure(move |rank, why| {
                if let Some(s) = report.get() {
                    let _ = s.cast(SchedulerMsg::ExecutorFailed { rank, error: format!("worker rank {rank}: {why}") });
                }
            });
        let collective = comm.actor();
        Ok((HeadSetup { group, world, expert_parallel, opts, collective, scheduler }, comm))
    }

    /// Publishes the scheduler to the workers and starts taking joins (the KV geometry every
    /// rank allocates is `kv`, the head's).
    pub async fn attach(
        self,
        scheduler: ActorRef<SchedulerMsg>,
        kv: KvGeometry,
        fingerprint: String,
    ) -> Result<(), String> {
        let _ = self.scheduler.set(scheduler.clone());
        ractor::pg::join(super::scheduler_group(&self.group), vec![scheduler.get_cell()]);
        let assignment = Assignment {
            group: self.group.clone(),
            world: self.world,
            kv,
            collective_timeout: self.opts.collective_timeout,
            expert_parallel: self.expert_parallel,
        };
        let state = HeadState {
            roster: Roster { assignment, fingerprint, joined: vec![None; self.world] },
            scheduler,
            collective: self.collective,
        };
        let (head, _) = Actor::spawn(None, HeadActor, state).await.map_err(|e| e.to_string())?;
        ractor::pg::join(super::HEAD_GROUP.to_string(), vec![head.get_cell()]);
        self.opts
            .node
            .cast(NodeServerMessage::SubscribeToEvents {
                id: "shelfserve-head".into(),
                subscription: Box::new(SessionWatch { head: head.clone() }),
            })
            .map_err(|e| e.to_string())?;
        metrics::gauge!("shelfserve_cluster_ranks_joined").set(1.0);
        for rank in 1..self.world {
            metrics::gauge!("shelfserve_cluster_rank_up", "rank" => rank.to_string()).set(0.0);
        }
        tracing::info!(group = %self.group, world = self.world, "head: waiting for workers to join");
        Ok(())
    }
}

struct HeadActor;

struct HeadState {
    roster: Roster,
    scheduler: ActorRef<SchedulerMsg>,
    collective: ActorRef<CollectiveMsg>,
}

/// Which worker ranks have joined (with their node addresses): each once, and only with the
/// head's model.
struct Roster {
    assignment: Assignment,
    fingerprint: String,
    joined: Vec<Option<String>>,
}

impl Roster {
    fn join(&mut self, req: &JoinRequest) -> Result<Assignment, String> {
        let world = self.assignment.world;
        if req.rank == 0 || req.rank >= world {
            return Err(format!("rank {} is not a worker rank of a group of {world} (1..{world})", req.rank));
        }
        if req.fingerprint != self.fingerprint {
            return Err("the worker's model differs from the head's (give every host the same model files)".into());
        }
        if self.joined[req.rank].is_some() {
            return Err(format!("rank {} has already joined", req.rank));
        }
        self.joined[req.rank] = Some(req.address.clone());
        Ok(self.assignment.clone())
    }

    fn has(&self, rank: usize) -> bool {
        self.joined.get(rank).is_some_and(Option::is_some)
    }

    fn count(&self) -> usize {
        self.joined.iter().flatten().count()
    }
}

impl Actor for HeadActor {
    type Msg = HeadMsg;
    type State = HeadState;
    type Arguments = HeadState;

    async fn pre_start(&self, _: ActorRef<HeadMsg>, state: HeadState) -> Result<HeadState, ActorProcessingErr> {
        Ok(state)
    }

    async fn handle(&self, _: ActorRef<HeadMsg>, msg: HeadMsg, st: &mut HeadState) -> Result<(), ActorProcessingErr> {
        match msg {
            HeadMsg::Join(req, reply) => {
                let answer = match decode::<JoinRequest>(&req) {
                    Ok(req) => {
                        let answer = st.roster.join(&req);
                        match &answer {
                            Ok(_) => {
                                tracing::info!(rank = req.rank, "head: worker joined");
                                metrics::gauge!("shelfserve_cluster_rank_up", "rank" => req.rank.to_string()).set(1.0);
                                let joined = st.roster.count() + 1;
                                metrics::gauge!("shelfserve_cluster_ranks_joined").set(joined as f64);
                            }
                            Err(e) => tracing::warn!(rank = req.rank, error = %e, "head: a worker was refused"),
                        }
                        answer
                    }
                    Err(_) => Err("a malformed join request".to_string()),
                };
                let _ = reply.send(encode(&answer).unwrap_or_default());
            }
            HeadMsg::Peers(_, reply) => {
                let _ = reply.send(encode(&st.roster.joined).unwrap_or_default());
            }
            HeadMsg::NodeDown(name, addr) => {
                let Some(rank) = super::rank_of_node(&name) else { return Ok(()) };
                if !st.roster.has(rank) {
                    return Ok(());
                }
                let why = format!("its node ({addr}) disconnected from the head");
                tracing::error!(rank, addr = %addr, "head: a worker disconnected; failing its requests");
                metrics::gauge!("shelfserve_cluster_rank_up", "rank" => rank.to_string()).set(0.0);
                metrics::counter!("shelfserve_cluster_rank_failures_total", "rank" => rank.to_string()).increment(1);
                // Every rank stops waiting in its collective, and the scheduler fails the requests.
                let _ = st.collective.cast(CollectiveMsg::Abort(rank as u64, why.clone()));
                let group = &st.roster.assignment.group;
                for r in (1..st.roster.assignment.world).filter(|&r| r != rank) {
                    for peer in ractor::pg::get_members(&super::collective_group(group, r)) {
                        let _ =
                            ActorRef::<CollectiveMsg>::from(peer).cast(CollectiveMsg::Abort(rank as u64, why.clone()));
                    }
                }
                let _ = st
                    .scheduler
                    .cast(SchedulerMsg::ExecutorFailed { rank, error: format!("worker rank {rank}: {why}") });
            }
        }
        Ok(())
    }
}

/// Forwards the node server's session events that matter to the `HeadActor`.
struct SessionWatch {
    head: ActorRef<HeadMsg>,
}

impl NodeEventSubscription for SessionWatch {
    fn node_session_opened(&self, _: NodeServerSessionInformation) {}

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        let name = ses.peer_name.map(|n| n.name).unwrap_or_default();
        let _ = self.head.cast(HeadMsg::NodeDown(name, ses.peer_addr));
    }

    fn node_session_authenticated(&self, _: NodeServerSessionInformation) {}
}

/// Rank 0's backend builder for a head of `device.tensor_parallel` ranks, the other ranks being
/// workers: CPU ranks of a llama-family or `glm5_next` model (with `--enable-expert-parallel`,
/// glm5_next's experts split whole). The split is checked before anything loads.
pub async fn head_rank0(
    opts: HeadOptions,
    bundle: Arc<crate::model::ModelBundle>,
    device: &crate::generate::ResolvedDevice,
    kv: KvGeometry,
    fingerprint: &str,
) -> Result<(HeadSetup, crate::generate::BackendMaker), String> {
    let cfg = &bundle.config;
    if device.kind != crate::generate::ResolvedKind::Cpu {
        return Err("--head runs CPU ranks only so far: CUDA ranks across processes need NCCL's unique id handed \
                    out through the cluster, which is not implemented yet"
            .into());
    }
    let world = device.tensor_parallel.max(1);
    let glm5 = super::glm5_rank::is_glm5(&bundle);
    if glm5 {
        super::glm5_rank::check_split(&bundle, world, device.expert_parallel)?;
    } else if device.expert_parallel {
        return Err(format!("--enable-expert-parallel needs a mixture-of-experts model, not `{}`", cfg.model_type));
    } else {
        let rank0 = crate::parallel::TpRank::new(0, world).map_err(|e| e.to_string())?;
        crate::parallel::LlamaShard::of_model(rank0, cfg).map_err(|e| e.to_string())?;
    }
    let join_wait = opts.join_wait;
    let (setup, comm) =
        HeadSetup::prepare(opts, fingerprint, world, device.expert_parallel).await.map_err(|e| e.to_string())?;
    // The head's host runs rank 0 only.
    let threads =
        if device.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { device.threads };
    let maker = if glm5 {
        super::glm5_rank::glm5_rank_maker(bundle, kv, threads, comm, join_wait, device.expert_parallel)
    } else {
        super::worker::cpu_rank_maker(bundle, kv, threads, comm, join_wait)
    };
    Ok((setup, maker))
}

/// The worker's side of `Join`: ask the head (found in its process group) for rank `rank`.
pub async fn join(
    rank: usize,
    fingerprint: String,
    address: String,
    wait: Duration,
) -> Result<(ActorRef<HeadMsg>, Assignment), super::ClusterError> {
    let head: ActorRef<HeadMsg> = super::wait_for_member(super::HEAD_GROUP, wait).await?.into();
    let req = encode(&JoinRequest { rank, fingerprint, address })
        .map_err(|_| super::ClusterError::Node("encoding".into()))?;
    let reply = ractor::call_t!(head, HeadMsg::Join, wait.as_millis() as u64, req)
        .map_err(|e| super::ClusterError::Node(format!("joining the head: {e}")))?;
    let answer: Result<Assignment, String> =
        decode(&reply).map_err(|_| super::ClusterError::Node("a malformed answer from the head".into()))?;
    answer.map(|a| (head.clone(), a)).map_err(|reason| super::ClusterError::Refused { rank, reason })
}

/// The node addresses of worker ranks `1..below`, once all of them have joined the head (polled
/// until `wait` is up).
pub async fn lower_peers(
    head: &ActorRef<HeadMsg>,
    below: usize,
    wait: Duration,
) -> Result<Vec<String>, super::ClusterError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let reply = ractor::call_t!(head, HeadMsg::Peers, 5000, 0)
            .map_err(|e| super::ClusterError::Node(format!("asking the head for the other workers: {e}")))?;
        let joined: Vec<Option<String>> =
            decode(&reply).map_err(|_| super::ClusterError::Node("a malformed answer from the head".into()))?;
        let lower: Vec<Option<String>> = (1..below).map(|r| joined.get(r).cloned().flatten()).collect();
        if lower.iter().all(Option::is_some) {
            return Ok(lower.into_iter().flatten().collect());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(super::ClusterError::Timeout(format!(
                "the workers of ranks 1..{below} did not all join within {wait:?}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_takes_each_worker_rank_once_and_only_for_its_model() {
        let kv = KvGeometry { block_size: 16, num_blocks: 8, state_slots: 4 };
        let assignment = Assignment {
            group: "g".into(),
            world: 3,
            kv,
            collective_timeout: Duration::from_secs(1),
            expert_parallel: true,
        };
        let mut roster = Roster { assignment: assignment.clone(), fingerprint: "abc".into(), joined: vec![None; 3] };
        let req = |rank, fp: &str| JoinRequest { rank, fingerprint: fp.into(), address: format!("h{rank}:1") };
        assert_eq!(roster.join(&req(2, "abc")), Ok(assignment));
        assert!(roster.join(&req(2, "abc")).unwrap_err().contains("already joined"));
        assert!(roster.join(&req(1, "xyz")).unwrap_err().contains("model differs"));
        assert!(roster.join(&req(0, "abc")).unwrap_err().contains("not a worker rank"));
        assert!(roster.join(&req(3, "abc")).unwrap_err().contains("not a worker rank"));
        assert!(roster.has(2) && !roster.has(1) && !roster.has(7));
        assert_eq!(roster.count(), 1);
        assert_eq!(roster.joined, [None, None, Some("h2:1".to_string())]);
        // The answer travels in postcard.
        let back: Result<Assignment, String> = decode(&encode(&roster.join(&req(1, "abc"))).unwrap()).unwrap();
        let back = back.unwrap();
        assert_eq!((back.world, back.expert_parallel), (3, true));
    }
}
