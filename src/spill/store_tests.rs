//! Unit tests of `SpillStore` on a real temporary directory: round trip, every corruption the
//! issues name (flipped bytes, truncation, deletion, a rewritten page with valid CRCs, a damaged
//! or missing index, crash leftovers, links and FIFOs at page paths), the byte budget,
//! persistence across a reopen, and unusable directories.

use super::*;

fn hash(n: u8) -> PageHash {
    PageHash([n; 16])
}

/// An image a bit over one CRC chunk, so corruption in the second chunk is tested too.
fn image(seed: u8) -> Vec<u8> {
    (0..CHUNK_BYTES + 1000).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

const LAYOUT: &str = "cpu/block16";

fn store(dir: &Path, budget: u64) -> SpillStore {
    SpillStore::open(dir, "model-x", LAYOUT, budget).expect("open")
}

fn file_len(p: &Path) -> u64 {
    fs::symlink_metadata(p).expect("meta").len()
}

#[test]
fn a_page_round_trips_with_its_parent() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut s = store(tmp.path(), 1 << 30);
    let img = image(1);
    assert_eq!(s.store(hash(2), Some(hash(1)), &img).expect("store"), (true, vec![]));
    assert_eq!(s.used_bytes(), file_len(&s.page_path(&hash(2))), "the budget counts whole files");
    assert_eq!(s.pages(), vec![SpilledPage { hash: hash(2), parent: Some(hash(1)) }]);
    assert_eq!(s.load(&hash(2)).expect("load"), img);
}

#[cfg(unix)]
#[test]
fn files_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tmp");
    let mut s = store(tmp.path(), 1 << 30);
    s.store(hash(1), None, &[1, 2, 3]).expect("store");
    let mode = |p: &Path| fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(&s.page_path(&hash(1))), 0o600);
    s.flush_index().expect("index");
    assert_eq!(mode(&s.dir().join(INDEX_FILE)), 0o600);
    assert_eq!(mode(&s.dir().join(super::secure::KEY_FILE)), 0o600);
    assert_eq!(mode(s.dir()), 0o700);
}

#[test]
fn a_flipped_byte_in_any_chunk_fails_its_crc_and_is_never_served_again() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut s = store(tmp.path(), 1 << 30);
    for (n, at, chunk) in [(1u8, 10usize, 0usize), (2, CHUNK_BYTES + 5, 1)] {
        s.store(hash(n), None, &image(n)).expect("store");
        let path = s.page_path(&hash(n));
        let mut bytes = fs::read(&path).expect("read");
        // The image follows the header and the MAC.
        let image_at = bytes.len() - image(n).len();
        bytes[image_at + at] ^= 0x40;
        fs::write(&path, &bytes).expect("write");
        let err = s.load(&hash(n)).expect_err("corrupt");
        assert_eq!(err, LoadError::Crc { page: hash(n).to_hex(), chunk });
        assert_eq!(err.kind(), "crc");
        assert!(!s.contains(&hash(n)) && !path.exists(), "a corrupt page is dropped");
        assert_eq!(s.load(&hash(n)), Err(LoadError::NotSpilled(hash(n).to_hex())));
    }
    assert_eq!(s.used_bytes(), 0);
}

#[test]
fn truncated_and_deleted_files_are_detected() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut s = store(tmp.path(), 1 << 30);
    s.store(hash(1), None, &image(1)).expect("store");
    s.store(hash(2), None, &image(2)).expect("store");
    let p1 = s.page_path(&hash(1));
    let full = fs::read(&p1).expect("read");
    fs::write(&p1, &full[..full.len() - 1]).expect("truncate");
    assert!(matches!(s.load(&hash(1)), Err(LoadError::Short { .. })));
    fs::remove_file(s.page_path(&hash(2))).expect("delete");
    assert_eq!(s.load(&hash(2)), Err(LoadError::Missing(hash(2).to_hex())));
    assert!(s.is_empty());
}

#[test]
fn the_budget_drops_the_oldest_pages_first() {
    let tmp = tempfile::tempdir().expect("tmp");
    let page_file = {
        let mut s = store(&tmp.path().join("probe"), 1 << 20);
        s.store(hash(1), None, &[1; 100]).expect("store");
        s.used_bytes()
    };
    let budget = 2 * page_file + page_file / 2;
    let mut s = store(tmp.path(), budget);
    for n in 1..=4u8 {
        let (stored, dropped) = s.store(hash(n), None, &[n; 100]).expect("store");
        assert!(stored);
        assert_eq!(dropped, if n >= 3 { vec![hash(n - 2)] } else { vec![] });
    }
    assert!(s.used_bytes() <= budget);
    assert!(!s.page_path(&hash(1)).exists(), "dropped pages lose their files");
    assert_eq!(s.store(hash(9), None, &vec![0; budget as usize]).expect("too big"), (false, vec![]));
    assert_eq!(s.load(&hash(4)).expect("newest kept"), vec![4; 100]);
}

#[test]
fn the_index_survives_a_reopen_and_is_keyed_by_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    let used = {
        let mut s = store(tmp.path(), 1 << 20);
        s.store(hash(1), None, &[7; 64]).expect("store");
        s.store(hash(2), Some(hash(1)), &[8; 64]).expect("store");
        s.flush_index().expect("index");
        s.used_bytes()
    };
    let mut s = store(tmp.path(), 1 << 20);
    assert_eq!(s.open_report(), &OpenReport { kept: 2, ..Default::default() }, "the index was used as is");
    assert_eq!(s.used_bytes(), used);
    assert_eq!(s.load(&hash(2)).expect("load"), vec![8; 64]);
    let other = SpillStore::open(tmp.path(), "model-y", LAYOUT, 1 << 20).expect("another model");
    assert!(other.is_empty(), "another model never sees these pages");
    // An index copied under the wrong model is not trusted: that folder is rebuilt from its files.
    fs::copy(s.dir().join(INDEX_FILE), other.dir().join(INDEX_FILE)).expect("copy");
    let other = SpillStore::open(tmp.path(), "model-y", LAYOUT, 1 << 20).expect("reopen");
    assert!(other.open_report().rebuilt.as_deref().is_some_and(|w| w.contains("model-x")), "{:?}", other.open_report());
    assert!(other.is_empty());
    // The same model under another KV layout: the pages' headers say which layout they hold.
    let other_layout = SpillStore::open(tmp.path(), "model-x", "cuda/bf16/block16", 1 << 20).expect("layout");
    assert!(other_layout.is_empty());
    assert_eq!(store(tmp.path(), 1 << 20).len(), 2, "and leaves the other layout's pages alone");
}

#[cfg(unix)]
#[test]
fn an_unwritable_directory_is_a_disk_error() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ro = tmp.path().join("ro");
    fs::create_dir(&ro).expect("mkdir");
    let mut s = store(&ro, 1 << 20);
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(s.dir(), fs::Permissions::from_mode(0o500)).expect("chmod");
    let res = s.store(hash(1), None, &[1; 10]);
    fs::set_permissions(s.dir(), fs::Permissions::from_mode(0o700)).expect("chmod back");
    // Root ignores permissions; only assert where they apply.
    if !is_root() {
        assert!(matches!(res, Err(SpillError::Disk { .. })), "{:?}", res.map(|r| r.0));
    }
    let file_as_root = tmp.path().join("file");
    fs::write(&file_as_root, b"x").expect("file");
    assert!(
        matches!(SpillStore::open(&file_as_root, "m", LAYOUT, 10), Err(SpillError::Disk { .. })),
        "a file is no directory"
    );
}

#[cfg(unix)]
fn is_root() -> bool {
    std::process::Command::new("id").arg("-u").output().map(|o| o.stdout.starts_with(b"0")).unwrap_or(false)
}

/// Pages spilled by a CPU engine, then the same model directory opened by engines whose resolved
/// device differs (`--device auto` on a CUDA machine, CUDA in another precision): their page
/// hashes differ, so the spilled files are a clean miss (never read, never restored), while the
/// same configuration restores them.
#[test]
fn a_page_spilled_under_one_kv_layout_is_a_clean_miss_under_another() {
    use crate::backend::cuda::Precision;
    use crate::generate::{DeviceKind, DeviceSelection, ResolvedDevice};
    use crate::kv::{KvPool, KvPoolConfig, PageHasher, PoolIdentity};

    let identity = |device: ResolvedDevice| PoolIdentity {
        model_fingerprint: "model-x".into(),
        kv_layout: device.kv_layout(4),
        rank: 0,
    };
    let auto = DeviceSelection { kind: DeviceKind::Auto, ..Default::default() };
    let on_cpu = identity(auto.resolve_with(|| Err("no libcuda".into())));
    let on_cuda = identity(auto.resolve_with(|| Ok(1)));
    let on_cuda_f32 = identity(DeviceSelection { cuda_precision: Precision::F32, ..auto }.resolve_with(|| Ok(1)));
    assert_eq!(on_cpu, identity(DeviceSelection::default().resolve_with(|| unreachable!("cpu needs no probe"))));
    assert_ne!(on_cpu, on_cuda);
    assert_ne!(on_cuda, on_cuda_f32);

    // Two 8-token pages (4-token blocks) of one conversation, spilled by the CPU engine.
    let tokens: Vec<u32> = (100..117).collect();
    let tmp = tempfile::tempdir().expect("tmp");
    {
        let mut s = store(tmp.path(), 1 << 20);
        let chain = PageHasher::new(&on_cpu).chain(&tokens, 8);
        s.store(chain[0], None, &[1; 64]).expect("store");
        s.store(chain[1], Some(chain[0]), &[2; 64]).expect("store");
    }
    // A restart: each engine's pool learns the spilled pages from the index, as the scheduler
    // does at startup, and asks which pages of the conversation it could restore.
    let restorable = |id: &PoolIdentity| {
        let mut s = store(tmp.path(), 1 << 20);
        let cfg = KvPoolConfig { num_blocks: 16, block_size: 4, page_tokens: 8, state_slots: 1, snapshot_bytes: 0 };
        let mut pool = KvPool::new(cfg, id).expect("pool");
        for p in s.pages() {
            pool.note_spilled(p.hash, p.parent);
        }
        pool.register(1, tokens.clone()).expect("register");
        let (candidates, _) = pool.restore_candidates(1);
        let chain = pool.hasher().chain(&tokens, 8);
        let loads: Vec<Result<Vec<u8>, LoadError>> = chain.iter().map(|h| s.load(h)).collect();
        (candidates.len(), loads)
    };
    let (n, loads) = restorable(&on_cpu);
    assert_eq!(n, 2, "the same configuration restores both pages");
    assert_eq!(loads, vec![Ok(vec![1; 64]), Ok(vec![2; 64])]);
    for other in [&on_cuda, &on_cuda_f32] {
        let (n, loads) = restorable(other);
        assert_eq!(n, 0, "{other:?} restores nothing");
        assert!(loads.iter().all(|l| matches!(l, Err(LoadError::NotSpilled(_)))), "{other:?}: {loads:?}");
    }
    // The miss left the CPU engine's files alone.
    assert_eq!(store(tmp.path(), 1 << 20).len(), 2);
}

/// Three pages on disk, the index written, then the store closed.
fn three_pages(root: &Path) -> PathBuf {
    let mut s = store(root, 1 << 30);
    for n in 1..=3u8 {
        s.store(hash(n), if n > 1 { Some(hash(n - 1)) } else { None }, &[n; 300]).expect("store");
    }
    s.flush_index().expect("index");
    s.dir().to_path_buf()
}

#[test]
fn a_damaged_or_missing_index_is_rebuilt_from_the_page_files() {
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 4] = [
        ("flipped byte", |p| {
            let mut b = fs::read(p).expect("read");
            let mid = b.len() / 2;
            b[mid] ^= 0x01;
            fs::write(p, b).expect("write");
        }),
        ("truncated", |p| {
            let b = fs::read(p).expect("read");
            fs::write(p, &b[..b.len() / 3]).expect("write");
        }),
        ("deleted", |p| fs::remove_file(p).expect("delete")),
        ("replaced by a link", |p| {
            fs::remove_file(p).expect("delete");
            std::os::unix::fs::symlink("/etc/hostname", p).expect("symlink");
        }),
    ];
    for (what, damage) in damages {
        let tmp = tempfile::tempdir().expect("tmp");
        let dir = three_pages(tmp.path());
        damage(&dir.join(INDEX_FILE));
        let mut s = store(tmp.path(), 1 << 30);
        let r = s.open_report().clone();
        assert!(r.rebuilt.is_some(), "{what}: {r:?}");
        assert_eq!(r.kept, 3, "{what}: every page kept");
        let mut pages = s.pages();
        pages.sort_by_key(|p| p.hash.0);
        assert_eq!(pages[2], SpilledPage { hash: hash(3), parent: Some(hash(2)) }, "{what}: parents come from headers");
        for n in 1..=3u8 {
            assert_eq!(s.load(&hash(n)).expect("load"), vec![n; 300], "{what}");
        }
        // The rebuilt index was written: the next open uses it as is.
        drop(s);
        assert_eq!(store(tmp.path(), 1 << 30).open_report().rebuilt, None, "{what}");
    }
}

#[test]
fn a_rebuild_discards_damaged_files_and_sweeps_crash_leftovers_and_strangers() {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = three_pages(tmp.path());
    fs::remove_file(dir.join(INDEX_FILE)).expect("no index");
    let s = store(tmp.path(), 1 << 30);
    // A damaged header (page 1), a truncated page (page 2), a crash's temp file, an older
    // format's index, a stray file and a link to a file that must survive.
    let p1 = s.page_path(&hash(1));
    let mut b = fs::read(&p1).expect("read");
    b[20] ^= 0xff;
    fs::write(&p1, b).expect("write");
    let p2 = s.page_path(&hash(2));
    let b = fs::read(&p2).expect("read");
    fs::write(&p2, &b[..b.len() - 1]).expect("write");
    fs::write(dir.join(format!("{}.kvpage.tmp", hash(7).to_hex())), b"half a page").expect("tmp");
    fs::write(dir.join("index.json"), b"{}").expect("old index");
    fs::write(dir.join("notes.txt"), b"?").expect("stray");
    let victim = tmp.path().join("victim");
    fs::write(&victim, b"precious").expect("victim");
    std::os::unix::fs::symlink(&victim, s.page_path(&hash(8))).expect("link");
    drop(s);
    // That open rebuilt and wrote an index; without one again, the files are all there is.
    fs::remove_file(dir.join(INDEX_FILE)).expect("no index");
    let mut s = store(tmp.path(), 1 << 30);
    let r = s.open_report().clone();
    assert_eq!((r.kept, r.damaged, r.temp, r.unknown, r.not_regular), (1, 2, 1, 2, 1), "{r:?}");
    assert!(r.rebuilt.is_some());
    assert_eq!(s.load(&hash(3)).expect("the intact page is kept"), vec![3; 300]);
    let mut left: Vec<String> =
        fs::read_dir(&dir).expect("dir").map(|e| e.expect("entry").file_name().into_string().expect("utf8")).collect();
    left.sort();
    assert_eq!(left, vec![format!("{}.kvpage", hash(3).to_hex()), INDEX_FILE.to_string(), "spill.key".to_string()]);
    assert_eq!(fs::read(&victim).expect("victim"), b"precious", "a link is removed, its target untouched");
}

#[test]
fn a_page_rewritten_with_valid_crcs_fails_its_mac_and_is_never_served() {
    use super::format::{crcs_of, encode_page_prefix, parse_page_prefix};
    let tmp = tempfile::tempdir().expect("tmp");
    let mut s = store(tmp.path(), 1 << 30);
    let img = image(1);
    s.store(hash(1), None, &img).expect("store");
    s.store(hash(2), None, &img).expect("store");
    s.flush_index().expect("index");
    // What someone who can write the folder but not read the key would do: change the image,
    // recompute every CRC (chunks and header), sign with a key of their own.
    let forge = |path: &Path| {
        let bytes = fs::read(path).expect("read");
        let parsed = parse_page_prefix(&bytes).expect("parse");
        let mut image = bytes[parsed.image_at..].to_vec();
        image[5] ^= 0x55;
        let mut header = parsed.header.clone();
        header.crcs = crcs_of(&image);
        let mut forged = encode_page_prefix(&[0u8; 32], &header, &image);
        forged.extend_from_slice(&image);
        fs::write(path, forged).expect("write");
    };
    forge(&s.page_path(&hash(1)));
    // With the index intact, the header no longer matches what was written.
    assert!(matches!(s.load(&hash(1)), Err(LoadError::Header { .. })));
    // With the index rewritten too (here: removed, so it is rebuilt from the forged header), the
    // CRCs all check out and the MAC is what catches it.
    forge(&s.page_path(&hash(2)));
    drop(s);
    fs::remove_file(tmp.path().join(format!("model-x.{}", LAYOUT.replace('/', "_"))).join(INDEX_FILE)).expect("rm");
    let mut s = store(tmp.path(), 1 << 30);
    assert!(s.contains(&hash(2)), "the forged header itself is well-formed");
    let err = s.load(&hash(2)).expect_err("tampered");
    assert_eq!(err, LoadError::Tampered(hash(2).to_hex()));
    assert_eq!(err.kind(), "tampered");
    assert!(!s.contains(&hash(2)) && !s.page_path(&hash(2)).exists(), "dropped for good");
}

#[test]
fn links_and_fifos_at_page_paths_are_never_followed_read_or_written_through() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut s = store(tmp.path(), 1 << 30);
    let victim = tmp.path().join("victim");
    fs::write(&victim, b"precious").expect("victim");
    // A link planted where a page is about to be written: the write replaces the link.
    std::os::unix::fs::symlink(&victim, s.page_path(&hash(1))).expect("link");
    std::os::unix::fs::symlink(&victim, s.dir().join(format!("{}.kvpage.tmp", hash(1).to_hex()))).expect("tmp link");
    s.store(hash(1), None, &[1; 50]).expect("store");
    assert_eq!(fs::read(&victim).expect("victim"), b"precious");
    assert!(fs::symlink_metadata(s.page_path(&hash(1))).expect("meta").file_type().is_file());
    assert_eq!(s.load(&hash(1)).expect("load"), vec![1; 50]);
    // A link swapped in for a stored page: not read, removed, target untouched.
    s.store(hash(2), None, &[2; 50]).expect("store");
    fs::remove_file(s.page_path(&hash(2))).expect("rm");
    std::os::unix::fs::symlink(&victim, s.page_path(&hash(2))).expect("link");
    assert!(matches!(s.load(&hash(2)), Err(LoadError::NotRegular { .. })));
    assert!(fs::symlink_metadata(s.page_path(&hash(2))).is_err(), "the link is gone");
    assert_eq!(fs::read(&victim).expect("victim"), b"precious");
    // A FIFO with no writer: a plain open would block forever; this returns at once.
    s.store(hash(3), None, &[3; 50]).expect("store");
    fs::remove_file(s.page_path(&hash(3))).expect("rm");
    let c = std::ffi::CString::new(s.page_path(&hash(3)).to_str().expect("utf8")).expect("cstr");
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let err = s.load(&hash(3)).expect_err("fifo");
    assert_eq!(err.kind(), "not_regular");
    assert!(!s.page_path(&hash(3)).exists());
}

#[test]
fn a_directory_others_can_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().expect("tmp");
    let root = tmp.path().join("spill");
    three_pages(&root);
    fs::set_permissions(&root, fs::Permissions::from_mode(0o777)).expect("chmod");
    let err = SpillStore::open(&root, "model-x", LAYOUT, 1 << 30).err().expect("refused");
    assert!(matches!(err, SpillError::Refused(_)), "{err}");
    assert!(err.to_string().contains("group or others"), "{err}");
    fs::set_permissions(&root, fs::Permissions::from_mode(0o700)).expect("chmod");
    assert_eq!(store(&root, 1 << 30).len(), 3, "the pages were left alone");
}
