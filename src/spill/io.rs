//! The spill tier's I/O thread: owns the `SpillStore` and runs every read and write on one OS
//! thread, never on the async runtime. Jobs arrive over `flume` channels (reads first: a request
//! may be waiting for one; writes are background work). A read carries a deadline: one that
//! expired while it queued is skipped, and [`SpillIo::load`] stops waiting at the deadline, so a
//! stalled disk turns into a miss (recompute), never a hung request. When the queues run dry the
//! thread brings the index up to date. It knows nothing of actors: outcomes of writes go to a
//! callback, in order.

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::store::{LoadError, SpillError, SpillStore};
use crate::kv::PageHash;

/// What became of a write (or a sync), reported in submission order.
#[derive(Debug)]
pub enum IoEvent {
    Stored {
        hash: PageHash,
        parent: Option<PageHash>,
        bytes: u64,
        dropped: Vec<PageHash>,
    },
    /// The image is larger than the whole budget: not stored.
    TooLarge {
        hash: PageHash,
    },
    /// A write failed (disk full or unwritable): spill should turn off; later writes are ignored.
    Failed(SpillError),
}

struct LoadJob {
    hash: PageHash,
    deadline: Instant,
    reply: flume::Sender<Result<Vec<u8>, LoadError>>,
}

enum WriteJob {
    Store {
        hash: PageHash,
        parent: Option<PageHash>,
        image: Vec<u8>,
    },
    /// Index and directory made durable; answered after every write queued before it.
    Sync(flume::Sender<Result<(), String>>),
}

/// The handle the actor holds; dropping it lets the thread finish its queue, write the index
/// and exit.
pub struct SpillIo {
    loads: flume::Sender<LoadJob>,
    writes: flume::Sender<WriteJob>,
    dir: PathBuf,
    _thread: JoinHandle<()>,
}

enum Next {
    Load(LoadJob),
    Write(WriteJob),
    Closed,
}

impl SpillIo {
    /// Starts the thread. `on_event` runs on it, once per write or sync, in order.
    pub fn start(store: SpillStore, on_event: impl Fn(IoEvent) + Send + 'static) -> std::io::Result<Self> {
        let (loads, load_rx) = flume::unbounded::<LoadJob>();
        let (writes, write_rx) = flume::unbounded::<WriteJob>();
        let dir = store.dir().to_path_buf();
        let thread = std::thread::Builder::new()
            .name("spill-io".into())
            .spawn(move || io_loop(store, load_rx, write_rx, on_event))?;
        Ok(SpillIo { loads, writes, dir, _thread: thread })
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Queues a write; its outcome goes to the event callback.
    pub fn store(&self, hash: PageHash, parent: Option<PageHash>, image: Vec<u8>) {
        let _ = self.writes.send(WriteJob::Store { hash, parent, image });
    }

    /// Reads a page, giving up at `deadline` (a miss: `LoadError::Deadline`).
    pub async fn load(&self, hash: PageHash, deadline: Duration) -> Result<Vec<u8>, LoadError> {
        let (reply, rx) = flume::bounded(1);
        let job = LoadJob { hash, deadline: Instant::now() + deadline, reply };
        let missed = || LoadError::Deadline(hash.to_hex());
        if self.loads.send(job).is_err() {
            return Err(LoadError::NotSpilled(hash.to_hex()));
        }
        match tokio::time::timeout(deadline, rx.recv_async()).await {
            Ok(Ok(result)) => result,
            // Dropped unanswered: the job expired in the queue.
            Ok(Err(_)) | Err(_) => Err(missed()),
        }
    }

    /// A future that resolves once every write queued so far is on disk and the index and the
    /// directory are synced.
    pub fn sync(&self) -> impl std::future::Future<Output = Result<(), String>> + Send + 'static {
        let (reply, rx) = flume::bounded(1);
        let sent = self.writes.send(WriteJob::Sync(reply)).is_ok();
        async move {
            if !sent {
                return Err("the spill I/O thread has stopped".to_string());
            }
            rx.recv_async().await.unwrap_or_else(|_| Err("the spill I/O thread has stopped".to_string()))
        }
    }
}

fn next_job(loads: &flume::Receiver<LoadJob>, writes: &flume::Receiver<WriteJob>) -> Next {
    flume::Selector::new()
        .recv(loads, |r| r.map(Next::Load).unwrap_or(Next::Closed))
        .recv(writes, |r| r.map(Next::Write).unwrap_or(Next::Closed))
        .wait()
}

fn io_loop(
    mut store: SpillStore,
    loads: flume::Receiver<LoadJob>,
    writes: flume::Receiver<WriteJob>,
    on_event: impl Fn(IoEvent),
) {
    let mut failed = false;
    loop {
        // Reads first: a request may be waiting for one.
        let job = match loads.try_recv() {
            Ok(j) => Next::Load(j),
            Err(_) => match writes.try_recv() {
                Ok(j) => Next::Write(j),
                Err(_) => {
                    if !failed {
                        if let Err(e) = store.flush_index() {
                            failed = true;
                            on_event(IoEvent::Failed(e));
                        }
                    }
                    match next_job(&loads, &writes) {
                        // One side closed: drain whatever the other still holds, then stop.
                        Next::Closed => {
                            if let Ok(l) = loads.try_recv() {
                                Next::Load(l)
                            } else if let Ok(w) = writes.try_recv() {
                                Next::Write(w)
                            } else {
                                break;
                            }
                        }
                        j => j,
                    }
                }
            },
        };
        match job {
            Next::Load(j) => {
                if Instant::now() >= j.deadline {
                    continue; // dropping `reply` tells the caller it was missed
                }
                let _ = j.reply.send(store.load(&j.hash));
            }
            Next::Write(WriteJob::Store { hash, parent, image }) => {
                if failed {
                    continue;
                }
                match store.store(hash, parent, &image) {
                    Ok((true, dropped)) => {
                        on_event(IoEvent::Stored { hash, parent, bytes: image.len() as u64, dropped })
                    }
                    Ok((false, _)) => on_event(IoEvent::TooLarge { hash }),
                    Err(e) => {
                        failed = true;
                        on_event(IoEvent::Failed(e));
                    }
                }
            }
            Next::Write(WriteJob::Sync(reply)) => {
                let r = if failed {
                    Err("spill is off after a disk error".to_string())
                } else {
                    store.sync().map_err(|e| e.to_string())
                };
                let _ = reply.send(r);
            }
            Next::Closed => break,
        }
    }
    if !failed {
        if let Err(e) = store.flush_index() {
            tracing::warn!(error = %e, "could not write the spill index at exit; the next start rebuilds it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    fn hash(n: u8) -> PageHash {
        PageHash([n; 16])
    }

    fn start(dir: &std::path::Path) -> (SpillIo, Arc<Mutex<Vec<IoEvent>>>) {
        let store = SpillStore::open(dir, "m", "cpu/block16", 1 << 30).expect("open");
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&events);
        let io = SpillIo::start(store, move |e| sink.lock().expect("lock").push(e)).expect("thread");
        (io, events)
    }

    #[tokio::test]
    async fn writes_are_reported_in_order_and_read_back_after_a_sync() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (io, events) = start(tmp.path());
        for n in 1..=3 {
            io.store(hash(n), None, vec![n; 1000]);
        }
        io.sync().await.expect("sync");
        let stored: Vec<PageHash> = events
            .lock()
            .expect("lock")
            .iter()
            .map(|e| match e {
                IoEvent::Stored { hash, .. } => *hash,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(stored, vec![hash(1), hash(2), hash(3)]);
        assert_eq!(io.load(hash(2), Duration::from_secs(5)).await.expect("load"), vec![2; 1000]);
        let reopened = {
            drop(io);
            // The index was synced: a reopen needs no rebuild.
            SpillStore::open(tmp.path(), "m", "cpu/block16", 1 << 30).expect("reopen")
        };
        assert_eq!(reopened.open_report().rebuilt, None);
        assert_eq!(reopened.len(), 3);
    }

    #[tokio::test]
    async fn a_read_stuck_behind_slow_disk_work_is_a_miss_at_its_deadline() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (io, _events) = start(tmp.path());
        io.store(hash(1), None, vec![1; 1000]);
        io.sync().await.expect("sync");
        // Keep the thread busy with large synced writes; the read queued behind them cannot make
        // a 1 ms deadline (it is a miss, not a wait).
        for n in 10..14 {
            io.store(hash(n), None, vec![n; 64 << 20]);
        }
        // Writes are taken in order, but a read waits for the write in progress.
        tokio::time::sleep(Duration::from_millis(5)).await;
        let started = Instant::now();
        let r = io.load(hash(1), Duration::from_millis(1)).await;
        assert_eq!(r, Err(LoadError::Deadline(hash(1).to_hex())));
        assert!(started.elapsed() < Duration::from_secs(1), "the caller did not wait for the disk");
        // The page is still there for a patient reader.
        assert_eq!(io.load(hash(1), Duration::from_secs(60)).await.expect("load"), vec![1; 1000]);
    }
}
