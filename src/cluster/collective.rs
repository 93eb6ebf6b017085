//! A [`Collective`] between ranks in different processes, carried by the cluster itself: every
//! rank has a `CollectiveActor` in its process group (`cluster::collective_group`), and a
//! collective is each rank casting its part to every other rank's actor, then waiting until all
//! parts of that operation are in. No socket protocol of its own: the parts are ractor_cluster
//! messages (`CollectiveMsg`, derived `RactorClusterMessage`) over the node sessions.
//!
//! Reductions add the parts in rank order exactly as `LocalComm` does, so every rank holds the
//! same bits as every other and as an in-process group. Speed is not the point (CPU ranks of CI
//! and small models; CUDA ranks move tensors over NCCL): correctness and failure are. A rank that
//! fails, a peer whose node disconnects (`CollectiveMsg::Abort`, sent by the head's session
//! watcher) or one that stays silent past the timeout poisons the group: every waiting rank
//! returns an error at once, and so does every later collective.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use ractor_cluster::RactorClusterMessage;

use crate::parallel::{Collective, CollectiveError};

/// A rank's part of one collective, or a rank's failure.
#[derive(RactorClusterMessage)]
pub enum CollectiveMsg {
    /// (operation number, sending rank, values).
    Part(u64, u64, Vec<f32>),
    /// (failed rank, why).
    Abort(u64, String),
}

#[derive(Default)]
struct InboxState {
    /// Parts received, by (operation, rank); a fast peer's next operation may arrive early.
    parts: HashMap<(u64, usize), Vec<f32>>,
    aborted: Option<String>,
}

#[derive(Default)]
struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
}

impl Inbox {
    fn abort(&self, reason: String) {
        self.state.lock().aborted.get_or_insert(reason);
        self.arrived.notify_all();
    }
}

struct CollectiveActor;

impl Actor for CollectiveActor {
    type Msg = CollectiveMsg;
    type State = Arc<Inbox>;
    type Arguments = Arc<Inbox>;

    async fn pre_start(&self, _: ActorRef<CollectiveMsg>, inbox: Arc<Inbox>) -> Result<Arc<Inbox>, ActorProcessingErr> {
        Ok(inbox)
    }

    async fn handle(
        &self,
        _: ActorRef<CollectiveMsg>,
        msg: CollectiveMsg,
        inbox: &mut Arc<Inbox>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CollectiveMsg::Part(op, from, values) => {
                inbox.state.lock().parts.insert((op, from as usize), values);
                inbox.arrived.notify_all();
            }
            CollectiveMsg::Abort(rank, why) => inbox.abort(format!("rank {rank} failed: {why}")),
        }
        Ok(())
    }
}

/// One rank's handle to a communicator of the cluster. Made with [`ClusterComm::start`] (in the
/// runtime), then [`ClusterComm::connect`] (blocking, on the rank's compute thread) before the
/// first collective.
pub struct ClusterComm {
    rank: usize,
    world: usize,
    group: String,
    timeout: Duration,
    inbox: Arc<Inbox>,
    actor: ActorRef<CollectiveMsg>,
    /// Every rank's collective actor, by rank (this rank's own included), once connected.
    peers: Mutex<Vec<ActorRef<CollectiveMsg>>>,
    next_op: AtomicU64,
    /// Told which rank failed when this rank gives up on one (a silent peer): the head reports it
    /// to the scheduler.
    on_peer_failure: Option<Box<dyn Fn(usize, String) + Send + Sync>>,
}

impl ClusterComm {
    /// Spawns this rank's collective actor and puts it in the rank's process group, where the
    /// other processes find it. `timeout` bounds every wait for another rank.
    pub async fn start(group: &str, rank: usize, world: usize, timeout: Duration) -> Result<Self, CollectiveError> {
        if world == 0 || rank >= world {
            return Err(CollectiveError::Invalid(format!("rank {rank} in a group of {world}")));
        }
        let inbox = Arc::new(Inbox::default());
        let (actor, _) = Actor::spawn(None, CollectiveActor, Arc::clone(&inbox))
            .await
            .map_err(|e| CollectiveError::Invalid(format!("starting the collective actor: {e}")))?;
        ractor::pg::join(super::collective_group(group, rank), vec![actor.get_cell()]);
        Ok(ClusterComm {
            rank,
            world,
            group: group.to_string(),
            timeout,
            inbox,
            actor,
            peers: Mutex::new(Vec::new()),
            next_op: AtomicU64::new(0),
            on_peer_failure: None,
        })
    }

    /// Calls `f(rank, why)` when this rank declares another one failed (it stopped answering).
    pub fn on_peer_failure(mut self, f: impl Fn(usize, String) + Send + Sync + 'static) -> Self {
        self.on_peer_failure = Some(Box::new(f));
        self
    }

    /// This rank's collective actor: a session watcher sends it `Abort` for a peer whose node is gone.
    pub fn actor(&self) -> ActorRef<CollectiveMsg> {
        self.actor.clone()
    }

    /// Waits (blocking) until every rank's collective actor is in its process group, up to `wait`.
    pub fn connect(&self, wait: Duration) -> Result<(), CollectiveError> {
        let deadline = Instant::now() + wait;
        loop {
            let found: Vec<Option<ActorRef<CollectiveMsg>>> = (0..self.world)
                .map(|r| {
                    ractor::pg::get_members(&super::collective_group(&self.group, r)).into_iter().next().map(Into::into)
                })
                .collect();
            if found.iter().all(Option::is_some) {
                *self.peers.lock() = found.into_iter().flatten().collect();
                return Ok(());
            }
            if let Some(r) = &self.inbox.state.lock().aborted {
                return Err(CollectiveError::Aborted(r.clone()));
            }
            if Instant::now() >= deadline {
                let missing: Vec<String> =
                    found.iter().enumerate().filter(|(_, p)| p.is_none()).map(|(r, _)| r.to_string()).collect();
                return Err(CollectiveError::Invalid(format!(
                    "rank(s) {} did not join the cluster within {wait:?}",
                    missing.join(", ")
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends `local` to every other rank as operation `op`'s part, waits for theirs, checks the
    /// sizes and hands all parts (rank order, this rank's own at its index) to `read`.
    fn exchange(&self, local: &[f32], read: impl FnOnce(&[&[f32]])) -> Result<(), CollectiveError> {
        if let Some(r) = &self.inbox.state.lock().aborted {
            return Err(CollectiveError::Aborted(r.clone()));
        }
        let op = self.next_op.fetch_add(1, Ordering::Relaxed);
        let peers = self.peers.lock().clone();
        if peers.len() != self.world {
            return Err(CollectiveError::Invalid("the cluster group is not connected".into()));
        }
        for (r, peer) in peers.iter().enumerate().filter(|(r, _)| *r != self.rank) {
            if peer.cast(CollectiveMsg::Part(op, self.rank as u64, local.to_vec())).is_err() {
                return Err(CollectiveError::Aborted(self.poison(r, "its node is unreachable")));
            }
        }
        let deadline = Instant::now() + self.timeout;
        let mut st = self.inbox.state.lock();
        let mut parts: Vec<Option<Vec<f32>>> = vec![None; self.world];
        loop {
            if let Some(r) = &st.aborted {
                return Err(CollectiveError::Aborted(r.clone()));
            }
            for (r, slot) in parts.iter_mut().enumerate().filter(|(r, _)| *r != self.rank) {
                if slot.is_none() {
                    *slot = st.parts.remove(&(op, r));
                }
            }
            let missing = parts.iter().enumerate().find(|(r, p)| *r != self.rank && p.is_none()).map(|(r, _)| r);
            let Some(missing) = missing else { break };
            if self.inbox.arrived.wait_until(&mut st, deadline).timed_out() && !st.parts.contains_key(&(op, missing)) {
                drop(st);
                let why = format!("it did not answer within {:?}", self.timeout);
                self.poison(missing, &why);
                if let Some(f) = &self.on_peer_failure {
                    f(missing, why);
                }
                return Err(CollectiveError::Timeout(self.timeout));
            }
        }
        drop(st);
        let expected = local.len();
        if let Some((rank, p)) = parts.iter().enumerate().find(|(_, p)| p.as_ref().is_some_and(|p| p.len() != expected))
        {
            let err = CollectiveError::SizeMismatch { rank, got: p.as_ref().map_or(0, Vec::len), expected };
            self.inbox.abort(err.to_string());
            return Err(err);
        }
        let all: Vec<&[f32]> = parts
            .iter()
            .enumerate()
            .map(|(r, p)| if r == self.rank { local } else { p.as_deref().unwrap_or(&[]) })
            .collect();
        read(&all);
        Ok(())
    }
}

impl ClusterComm {
    /// Marks the group failed because of rank `failed` here and at every other rank that can
    /// still be reached; returns the message every rank reports.
    fn poison(&self, failed: usize, why: &str) -> String {
        let msg = format!("rank {failed} failed: {why}");
        self.inbox.abort(msg.clone());
        for (r, peer) in self.peers.lock().iter().enumerate() {
            if r != self.rank && r != failed {
                let _ = peer.cast(CollectiveMsg::Abort(failed as u64, why.to_string()));
            }
        }
        msg
    }
}

impl Collective for ClusterComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        let local = buf.to_vec();
        // Rank order, the first part copied and the others added one by one: `LocalComm`'s bits.
        self.exchange(&local, |parts| {
            buf.copy_from_slice(parts[0]);
            for p in &parts[1..] {
                buf.iter_mut().zip(*p).for_each(|(b, &x)| *b += x);
            }
        })
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        if out.len() != local.len() * self.world {
            return Err(CollectiveError::SizeMismatch {
                rank: self.rank,
                got: out.len(),
                expected: local.len() * self.world,
            });
        }
        if self.world == 1 || local.is_empty() {
            out.copy_from_slice(local);
            return Ok(());
        }
        self.exchange(local, |parts| {
            for (dst, p) in out.chunks_exact_mut(local.len()).zip(parts) {
                dst.copy_from_slice(p);
            }
        })
    }

    fn abort(&self, reason: &str) {
        self.poison(self.rank, reason);
    }
}

impl Drop for ClusterComm {
    fn drop(&mut self) {
        self.actor.stop(None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::LocalComm;

    /// A group of `world` ranks in this process (their actors are local members of the process
    /// groups, reached exactly as remote ones are), each run on its own thread.
    fn run_ranks<T: Send + 'static>(
        name: &str,
        world: usize,
        timeout: Duration,
        f: impl Fn(ClusterComm) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let comms: Vec<ClusterComm> = rt.block_on(async {
            let mut v = Vec::new();
            for r in 0..world {
                v.push(ClusterComm::start(name, r, world, timeout).await.unwrap());
            }
            v
        });
        let f = Arc::new(f);
        // Everyone is connected before anyone runs (a rank that returns leaves its group).
        let connected = Arc::new(std::sync::Barrier::new(world));
        let handles: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let (f, connected) = (Arc::clone(&f), Arc::clone(&connected));
                std::thread::spawn(move || {
                    c.connect(Duration::from_secs(5)).unwrap();
                    connected.wait();
                    f(c)
                })
            })
            .collect();
        let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
        rt.shutdown_timeout(Duration::from_secs(1));
        out
    }

    fn values(rank: usize, round: usize) -> Vec<f32> {
        (0..23).map(|i| ((rank * 7919 + i * 31 + round) as f32).sin() * 1e3 / (i + 1) as f32).collect()
    }

    #[test]
    fn reductions_and_gathers_equal_the_in_process_group_bit_for_bit() {
        for world in [2, 3] {
            let local: Vec<Vec<Vec<f32>>> = {
                let comms = LocalComm::group(world, Duration::from_secs(10)).unwrap();
                let hs: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        std::thread::spawn(move || {
                            (0..50)
                                .map(|round| {
                                    let mut b = values(c.rank(), round);
                                    c.all_reduce_sum(&mut b).unwrap();
                                    b
                                })
                                .collect()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            };
            let remote = run_ranks(&format!("test.reduce.{world}"), world, Duration::from_secs(10), |c| {
                let sums: Vec<Vec<f32>> = (0..50)
                    .map(|round| {
                        let mut b = values(c.rank(), round);
                        c.all_reduce_sum(&mut b).unwrap();
                        b
                    })
                    .collect();
                let part = vec![c.rank() as f32; 3];
                let mut gathered = vec![0.0; 3 * c.world_size()];
                c.all_gather(&part, &mut gathered).unwrap();
                (sums, gathered)
            });
            for (r, (sums, gathered)) in remote.iter().enumerate() {
                let bits = |v: &Vec<Vec<f32>>| v.iter().flatten().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(sums), bits(&local[r]), "world {world} rank {r}");
                let expect: Vec<f32> = (0..world).flat_map(|q| [q as f32; 3]).collect();
                assert_eq!(gathered, &expect);
            }
        }
    }

    #[test]
    fn a_failed_or_silent_rank_is_an_error_not_a_hang() {
        let results = run_ranks("test.abort", 3, Duration::from_secs(10), |c| {
            if c.rank() == 1 {
                c.abort("out of memory");
                return Err(CollectiveError::Aborted("self".into()));
            }
            c.all_reduce_sum(&mut [1.0; 4])
        });
        for r in [&results[0], &results[2]] {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("rank 1 failed: out of memory"), "{e}");
        }
        // Rank 1 never takes part: rank 0 gives up after the timeout and names it.
        let failed = Arc::new(Mutex::new(None));
        let seen = Arc::clone(&failed);
        let started = Instant::now();
        let results = run_ranks("test.silent", 2, Duration::from_millis(300), move |c| {
            let seen = Arc::clone(&seen);
            let c = c.on_peer_failure(move |rank, why| *seen.lock() = Some((rank, why)));
            if c.rank() == 1 {
                // Present (its actor answers nothing) but silent.
                std::thread::sleep(Duration::from_secs(1));
                return None;
            }
            Some(c.all_reduce_sum(&mut [1.0]))
        });
        assert!(matches!(results[0], Some(Err(CollectiveError::Timeout(_)))), "{:?}", results[0]);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(failed.lock().as_ref().map(|f| f.0), Some(1));
        let sizes =
            run_ranks("test.sizes", 2, Duration::from_secs(10), |c| c.all_reduce_sum(&mut vec![1.0; 2 + c.rank()]));
        assert!(sizes.iter().all(|r| matches!(r, Err(CollectiveError::SizeMismatch { .. }))), "{sizes:?}");
    }
}
