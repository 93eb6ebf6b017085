//! Collectives behind two traits: [`Collective`] on host `f32` slices, with the in-process
//! implementation for CPU ranks (threads of one process) here, and [`DeviceCollective`] on device
//! memory, implemented by NCCL in the CUDA backend (`backend::cuda::nccl`). Both have the same
//! semantics (sum in place, gather in rank order, abort releases the group).
//!
//! Reductions add the ranks' contributions in rank order on every rank, so all ranks hold
//! bitwise-identical results and a run is reproducible (the same choice NCCL makes for a fixed
//! algorithm and rank count). A rank that fails poisons the group: the others get an error at
//! their next collective instead of waiting forever.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    #[error("collective aborted: {0}")]
    Aborted(String),
    #[error("collective timed out after {0:?} waiting for the other ranks")]
    Timeout(Duration),
    #[error("collective size mismatch: rank {rank} gave {got} values, expected {expected}")]
    SizeMismatch { rank: usize, got: usize, expected: usize },
    #[error("invalid group: {0}")]
    Invalid(String),
}

/// One rank's handle to a communicator.
pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over ranks, in place; every rank gets the same result.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError>;
    /// Concatenate every rank's equally sized `local` part in rank order into `out`
    /// (`out.len() == local.len() * world_size`).
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError>;
    /// Tell the other ranks this one failed, so they stop waiting.
    fn abort(&self, reason: &str);
}

/// One rank's handle to a communicator over device memory: collectives are enqueued on the rank's
/// stream (in order with its kernels) and complete asynchronously; errors are those of enqueueing
/// (a peer's failure surfaces when the stream is synchronised, after the group was aborted).
pub trait DeviceCollective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Element-wise sum over ranks of `count` f32 at device address `buf`, in place.
    ///
    /// # Safety
    /// `buf` must point to `count` f32 in this rank's device memory, live until the rank's stream
    /// has passed this operation.
    unsafe fn all_reduce_sum_f32(&self, buf: u64, count: usize) -> Result<(), CollectiveError>;
    /// Every rank's `count` f32 at `send`, concatenated in rank order into `recv`.
    ///
    /// # Safety
    /// `send` must hold `count` and `recv` `count · world_size` f32 in this rank's device memory,
    /// live until the rank's stream has passed this operation.
    unsafe fn all_gather_f32(&self, send: u64, recv: u64, count: usize) -> Result<(), CollectiveError>;
    /// Tell the other ranks this one failed and release any of them waiting in a collective.
    fn abort(&self, reason: &str);
}

struct State {
    /// Each rank's contribution to the collective in progress.
    parts: Vec<Vec<f32>>,
    arrived: usize,
    /// Completed rendezvous; a rank waits for this to move past the value it saw on arrival.
    generation: u64,
    aborted: Option<String>,
}

struct Shared {
    world: usize,
    timeout: Duration,
    state: Mutex<State>,
    turn: Condvar,
}

impl Shared {
    /// Wait until every rank arrived (generation advanced) or the group is aborted.
    fn rendezvous(&self, st: &mut parking_lot::MutexGuard<'_, State>) -> Result<(), CollectiveError> {
        if let Some(r) = &st.aborted {
            return Err(CollectiveError::Aborted(r.clone()));
        }
        let gen = st.generation;
        st.arrived += 1;
        if st.arrived == self.world {
            st.arrived = 0;
            st.generation += 1;
            self.turn.notify_all();
            return Ok(());
        }
        while st.generation == gen {
            if let Some(r) = &st.aborted {
                return Err(CollectiveError::Aborted(r.clone()));
            }
            if self.turn.wait_for(st, self.timeout).timed_out() && st.generation == gen {
                let msg = format!("rank timed out after {:?}", self.timeout);
                st.aborted = Some(msg);
                self.turn.notify_all();
                return Err(CollectiveError::Timeout(self.timeout));
            }
        }
        Ok(())
    }
}

/// In-process communicator for CPU ranks: create one group, hand one [`LocalComm`] to each rank
/// thread.
#[derive(Clone)]
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// A group of `world` ranks. `timeout` bounds how long a rank waits for the others (a rank
    /// stuck in a kernel for longer than this is treated as failed).
    pub fn group(world: usize, timeout: Duration) -> Result<Vec<LocalComm>, CollectiveError> {
        if world == 0 {
            return Err(CollectiveError::Invalid("world size must be at least 1".into()));
        }
        let shared = Arc::new(Shared {
            world,
            timeout,
            state: Mutex::new(State { parts: vec![Vec::new(); world], arrived: 0, generation: 0, aborted: None }),
            turn: Condvar::new(),
        });
        Ok((0..world).map(|rank| LocalComm { rank, shared: Arc::clone(&shared) }).collect())
    }

    /// Deposit `local`, wait for everyone, read all parts with `read`, then wait again so nobody
    /// overwrites a part another rank is still reading.
    fn exchange(&self, local: &[f32], read: impl FnOnce(&[Vec<f32>])) -> Result<(), CollectiveError> {
        let s = &self.shared;
        let mut st = s.state.lock();
        st.parts[self.rank].clear();
        st.parts[self.rank].extend_from_slice(local);
        s.rendezvous(&mut st)?;
        let expected = local.len();
        if let Some((rank, p)) = st.parts.iter().enumerate().find(|(_, p)| p.len() != expected) {
            let err = CollectiveError::SizeMismatch { rank, got: p.len(), expected };
            st.aborted = Some(err.to_string());
            s.turn.notify_all();
            return Err(err);
        }
        read(&st.parts);
        s.rendezvous(&mut st)
    }
}

impl Collective for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if self.shared.world == 1 {
            return Ok(());
        }
        let local = buf.to_vec();
        self.exchange(&local, |parts| {
            buf.copy_from_slice(&parts[0]);
            for p in &parts[1..] {
                buf.iter_mut().zip(p).for_each(|(b, &x)| *b += x);
            }
        })
    }

    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), CollectiveError> {
        let world = self.shared.world;
        if out.len() != local.len() * world {
            return Err(CollectiveError::SizeMismatch {
                rank: self.rank,
                got: out.len(),
                expected: local.len() * world,
            });
        }
        // Nothing to gather (every rank's part is empty, the sizes already checked above).
        if world == 1 || local.is_empty() {
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
        let mut st = self.shared.state.lock();
        st.aborted.get_or_insert_with(|| format!("rank {} failed: {reason}", self.rank));
        self.shared.turn.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_ranks<T: Send + 'static>(world: usize, f: impl Fn(LocalComm) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = LocalComm::group(world, Duration::from_secs(10))
            .unwrap()
            .into_iter()
            .map(|c| {
                let f = Arc::clone(&f);
                std::thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        for world in [1, 2, 3, 4] {
            let results = run_ranks(world, |c| {
                let mut out = Vec::new();
                // Many rounds back to back: parts must never be overwritten while being read.
                for round in 0..200 {
                    let mut buf: Vec<f32> = (0..17).map(|i| (c.rank() * 1000 + i + round) as f32 * 0.1).collect();
                    c.all_reduce_sum(&mut buf).unwrap();
                    out.push(buf);
                }
                out
            });
            for round in 0..200 {
                let expect: Vec<f32> = (0..17)
                    .map(|i| {
                        let mut acc = (i + round) as f32 * 0.1;
                        for r in 1..world {
                            acc += (r * 1000 + i + round) as f32 * 0.1;
                        }
                        acc
                    })
                    .collect();
                for r in &results {
                    assert_eq!(r[round], expect, "world {world} round {round}");
                }
            }
        }
    }

    #[test]
    fn all_gather_concatenates_in_rank_order() {
        let results = run_ranks(3, |c| {
            let local = vec![c.rank() as f32; 4];
            let mut out = vec![0.0; 12];
            c.all_gather(&local, &mut out).unwrap();
            out
        });
        for out in results {
            assert_eq!(out, [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]);
        }
    }

    #[test]
    fn a_failed_rank_releases_the_others_with_an_error() {
        let results = run_ranks(3, |c| {
            if c.rank() == 1 {
                c.abort("out of memory");
                return Err(CollectiveError::Aborted("self".into()));
            }
            let mut buf = vec![1.0; 4];
            c.all_reduce_sum(&mut buf)
        });
        for r in [&results[0], &results[2]] {
            let e = r.as_ref().unwrap_err().to_string();
            assert!(e.contains("rank 1 failed: out of memory"), "{e}");
        }
    }

    #[test]
    fn mismatched_sizes_and_silent_ranks_are_errors_not_hangs() {
        let results = run_ranks(2, |c| {
            let mut buf = vec![1.0; 3 + c.rank()];
            c.all_reduce_sum(&mut buf)
        });
        assert!(results.iter().all(|r| matches!(r, Err(CollectiveError::SizeMismatch { .. }))));
        let mut group = LocalComm::group(2, Duration::from_millis(50)).unwrap();
        let lonely = group.remove(0);
        let e = lonely.all_reduce_sum(&mut [1.0]).unwrap_err();
        assert!(matches!(e, CollectiveError::Timeout(_)), "{e}");
        assert!(LocalComm::group(0, Duration::from_secs(1)).is_err());
    }
}
