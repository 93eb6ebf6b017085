//! `kill -9` during spill writes (issue 21): a child process (this test binary, re-run in writer
//! mode) writes pages as fast as it can, rewriting the index now and then, and reports each page
//! once `store` returned; the parent kills it with SIGKILL at varied moments, then reopens the
//! directory. Every reported page must be there and read back exactly; at most the one page in
//! flight may be missing; nothing damaged is ever served.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use shelfserve::kv::PageHash;
use shelfserve::spill::SpillStore;

const CHILD_ENV: &str = "SHELFSERVE_SPILL_CRASH_WRITER";
const LAYOUT: &str = "cpu/block16";
const PAGE_BYTES: usize = 3 << 20;

fn hash(n: u32) -> PageHash {
    let mut h = [0u8; 16];
    h[..4].copy_from_slice(&n.to_le_bytes());
    h[15] = 0xaa;
    PageHash(h)
}

fn image(n: u32) -> Vec<u8> {
    (0..PAGE_BYTES).map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(n) as u8).collect()
}

/// Writer mode: pages `start..`, each reported on stdout after `store` returned.
fn write_forever(dir: &Path, start: u32) -> ! {
    let mut s = SpillStore::open(dir, "model-crash", LAYOUT, 1 << 40).expect("open");
    for n in start.. {
        s.store(hash(n), n.checked_sub(1).map(hash), &image(n)).expect("store");
        if n % 3 == 0 {
            s.flush_index().expect("index");
        }
        println!("stored {n}");
    }
    unreachable!()
}

#[test]
fn kill_9_during_spill_writes_loses_at_most_the_page_in_flight() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        let start = std::env::var("SHELFSERVE_SPILL_CRASH_START").ok().and_then(|s| s.parse().ok()).unwrap_or(0);
        write_forever(Path::new(&dir), start);
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let mut next = 0u32;
    // Kill after a varied number of reported pages, so the signal lands in different places
    // (mid-write, mid-rename, mid-index); then each round resumes where the last one stopped.
    for (round, wait_for) in [1usize, 4, 2, 7, 3].into_iter().enumerate() {
        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .args(["--exact", "kill_9_during_spill_writes_loses_at_most_the_page_in_flight", "--nocapture"])
            .env(CHILD_ENV, tmp.path())
            .env("SHELFSERVE_SPILL_CRASH_START", next.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn writer");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let mut reported = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        while reported.len() < wait_for && Instant::now() < deadline {
            let line = lines.next().expect("the writer reports").expect("line");
            if let Some(n) = line.strip_prefix("stored ") {
                reported.push(n.parse::<u32>().expect("number"));
            }
        }
        // A little later, at a moment the writer does not choose.
        std::thread::sleep(Duration::from_millis(7 * round as u64));
        child.kill().expect("SIGKILL");
        child.wait().expect("reaped");
        // Pages reported after the ones we waited for count too (they were stored).
        reported.extend(lines.map_while(Result::ok).filter_map(|l| l.strip_prefix("stored ")?.parse::<u32>().ok()));

        let mut s = SpillStore::open(tmp.path(), "model-crash", LAYOUT, 1 << 40).expect("reopen");
        let last = *reported.last().expect("some pages");
        for n in 0..=last {
            assert_eq!(s.load(&hash(n)).as_deref(), Ok(&image(n)[..]), "round {round}: page {n} was stored");
        }
        assert!(s.len() as u32 <= last + 2, "round {round}: at most the page in flight beyond the reported ones");
        if s.contains(&hash(last + 1)) {
            assert_eq!(s.load(&hash(last + 1)).as_deref(), Ok(&image(last + 1)[..]), "a page is whole or absent");
        }
        let left_over: Vec<_> = std::fs::read_dir(s.dir())
            .expect("dir")
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".tmp"))
            .collect();
        assert!(left_over.is_empty(), "round {round}: crash leftovers are swept: {left_over:?}");
        next =
            s.pages().iter().map(|p| u32::from_le_bytes(p.hash.0[..4].try_into().expect("4"))).max().unwrap_or(0) + 1;
    }
}
