//! The spill tier's I/O threads: one owns the `SpillStore` and runs every write and every index
//! change, never on the async runtime; the page reads it hands, detached from the store
//! (`PageRead`), to [`PARALLEL_READS`] reader threads, so the pages of one restore are read in
//! parallel. Jobs arrive over `flume` channels (reads first: a request may be waiting for one;
//! writes are background work). A read carries a deadline: one that expired while it queued is
//! skipped, and [`SpillIo::load`] stops waiting at the deadline, so a stalled disk turns into a
//! miss (recompute), never a hung request. A read that fails removes the file and has the store
//! thread drop its entry. When the queues run dry the store thread brings the index up to date.
//! It knows nothing of actors: outcomes of writes go to a callback, in order.

use std::path::PathBuf;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::store::{LoadError, PageRead, SpillError, SpillStore};

/// Reader threads: the pages of one restore are read this many at a time.
pub const PARALLEL_READS: usize = 4;
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

/// A load the store thread resolved to a file, for a reader thread.
struct ReadJob {
    read: PageRead,
    deadline: Instant,
    reply: flume::Sender<Result<Vec<u8>, LoadError>>,
}

enum WriteJob {
    Store {
        hash: PageHash,
        parent: Option<PageHash>,
        image: bytes::Bytes,
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
    /// A reader thread's read failed: drop the page's entry.
    Failed(PageHash),
    Closed,
}

impl SpillIo {
    /// Starts the thread. `on_event` runs on it, once per write or sync, in order.
    pub fn start(store: SpillStore, on_event: impl Fn(IoEvent) + Send + 'static) -> std::io::Result<Self> {
        let (loads, load_rx) = flume::unbounded::<LoadJob>();
        let (writes, write_rx) = flume::unbounded::<WriteJob>();
        let (reads, read_rx) = flume::unbounded::<ReadJob>();
        let (failed, failed_rx) = flume::unbounded::<PageHash>();
        for i in 0..PARALLEL_READS {
            let (jobs, failed) = (read_rx.clone(), failed.clone());
            // They end when the store thread drops `reads` (it exits last).
            std::thread::Builder::new().name(format!("spill-read-{i}")).spawn(move || read_loop(jobs, failed))?;
        }
        let dir = store.dir().to_path_buf();
        let thread = std::thread::Builder::new().name("spill-io".into()).spawn(move || {
            io_loop(store, Queues { loads: load_rx, writes: write_rx, failed: failed_rx, reads }, on_event)
        })?;
        Ok(SpillIo { loads, writes, dir, _thread: thread })
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// Queues a write; its outcome goes to the event callback.
    pub fn store(&self, hash: PageHash, parent: Option<PageHash>, image: bytes::Bytes) {
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

/// A reader thread: runs detached page reads until the store thread goes away.
fn read_loop(jobs: flume::Receiver<ReadJob>, failed: flume::Sender<PageHash>) {
    while let Ok(j) = jobs.recv() {
        if Instant::now() >= j.deadline {
            continue; // dropping `reply` tells the caller it was missed
        }
        let result = j.read.run();
        if result.is_err() {
            let _ = failed.send(j.read.hash());
        }
        let _ = j.reply.send(result);
    }
}

/// The store thread's channels.
struct Queues {
    loads: flume::Receiver<LoadJob>,
    writes: flume::Receiver<WriteJob>,
    failed: flume::Receiver<PageHash>,
    /// To the reader threads.
    reads: flume::Sender<ReadJob>,
}

fn next_job(q: &Queues) -> Next {
    flume::Selector::new()
        .recv(&q.failed, |r| r.map(Next::Failed).unwrap_or(Next::Closed))
        .recv(&q.loads, |r| r.map(Next::Load).unwrap_or(Next::Closed))
        .recv(&q.writes, |r| r.map(Next::Write).unwrap_or(Next::Closed))
        .wait()
}

fn io_loop(mut store: SpillStore, q: Queues, on_event: impl Fn(IoEvent)) {
    let (loads, writes) = (&q.loads, &q.writes);
    let mut failed = false;
    loop {
        // Failed reads, then reads: a request may be waiting for one.
        let job = match q.failed.try_recv().map(Next::Failed).or_else(|_| loads.try_recv().map(Next::Load)) {
            Ok(j) => j,
            Err(_) => match writes.try_recv() {
                Ok(j) => Next::Write(j),
                Err(_) => {
                    if !failed {
                        if let Err(e) = store.flush_index() {
                            failed = true;
                            on_event(IoEvent::Failed(e));
                        }
                    }
                    match next_job(&q) {
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
                // The file is read on a reader thread; a store that lost the page answers now.
                match store.page_read(&j.hash) {
                    Ok(read) => {
                        let job = ReadJob { read, deadline: j.deadline, reply: j.reply };
                        if let Err(flume::SendError(job)) = q.reads.send(job) {
                            let _ = job.reply.send(Err(LoadError::NotSpilled(j.hash.to_hex())));
                        }
                    }
                    Err(e) => {
                        let _ = j.reply.send(Err(e));
                    }
                }
            }
            Next::Failed(hash) => store.forget_failed(&hash),
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
            io.store(hash(n), None, vec![n; 1000].into());
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
    async fn reads_run_in_parallel_and_a_failed_one_drops_its_page() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (io, _events) = start(tmp.path());
        for n in 1..=8 {
            io.store(hash(n), None, vec![n; 100_000].into());
        }
        io.sync().await.expect("sync");
        let loads = (1..=8).map(|n| io.load(hash(n), Duration::from_secs(30)));
        let images = futures_util::future::join_all(loads).await;
        for (n, image) in (1..=8u8).zip(images) {
            assert_eq!(image.expect("load"), vec![n; 100_000]);
        }
        // Flip a byte of page 3's image: the reader finds the CRC mismatch, removes the file, and
        // the store thread drops the entry before it takes the next load.
        let path = io.dir().join(format!("{}.kvpage", hash(3).to_hex()));
        let mut bytes = std::fs::read(&path).expect("read");
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&path, &bytes).expect("write");
        let r = io.load(hash(3), Duration::from_secs(30)).await;
        assert!(matches!(r, Err(LoadError::Crc { .. }) | Err(LoadError::Tampered(_))), "{r:?}");
        assert!(!path.exists(), "the damaged file is removed");
        let again = io.load(hash(3), Duration::from_secs(30)).await;
        assert_eq!(again, Err(LoadError::NotSpilled(hash(3).to_hex())));
    }

    #[tokio::test]
    async fn a_read_stuck_behind_slow_disk_work_is_a_miss_at_its_deadline() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (io, _events) = start(tmp.path());
        io.store(hash(1), None, vec![1; 1000].into());
        io.sync().await.expect("sync");
        // Keep the thread busy with large synced writes; the read queued behind them cannot make
        // a 1 ms deadline (it is a miss, not a wait).
        for n in 10..14 {
            io.store(hash(n), None, vec![n; 64 << 20].into());
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
