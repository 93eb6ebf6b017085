//! Unit tests of `SpillStore` on a real temporary directory: round trip, every corruption the
//! issue names (flipped bytes, truncation, deletion), the byte budget, persistence across a
//! reopen, and an unwritable directory.

use super::*;

fn hash(n: u8) -> PageHash {
    PageHash([n; 16])
}

/// An image a bit over one CRC chunk, so corruption in the second chunk is tested too.
fn image(seed: u8) -> Vec<u8> {
    (0..CHUNK_BYTES + 1000).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

fn store(dir: &Path, budget: u64) -> SpillStore {
    SpillStore::open(dir, "model-x", budget).expect("open")
}

#[test]
fn a_page_round_trips_with_its_parent() {
    let tmp = tempfile::tempdir().expect("tmp");
    let mut s = store(tmp.path(), 1 << 30);
    let img = image(1);
    assert_eq!(s.store(hash(2), Some(hash(1)), &img).expect("store"), (true, vec![]));
    assert_eq!(s.used_bytes(), img.len() as u64);
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
    assert_eq!(mode(&s.dir().join("index.json")), 0o600);
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
        bytes[at] ^= 0x40;
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
    let mut s = store(tmp.path(), 250);
    for n in 1..=4u8 {
        let (stored, dropped) = s.store(hash(n), None, &[n; 100]).expect("store");
        assert!(stored);
        assert_eq!(dropped, if n >= 3 { vec![hash(n - 2)] } else { vec![] });
    }
    assert!(s.used_bytes() <= 250);
    assert!(!s.page_path(&hash(1)).exists(), "dropped pages lose their files");
    assert_eq!(s.store(hash(9), None, &[0; 300]).expect("too big"), (false, vec![]));
    assert_eq!(s.load(&hash(4)).expect("newest kept"), vec![4; 100]);
}

#[test]
fn the_index_survives_a_reopen_and_is_keyed_by_model() {
    let tmp = tempfile::tempdir().expect("tmp");
    {
        let mut s = store(tmp.path(), 1 << 20);
        s.store(hash(1), None, &[7; 64]).expect("store");
        s.store(hash(2), Some(hash(1)), &[8; 64]).expect("store");
    }
    let mut s = store(tmp.path(), 1 << 20);
    assert_eq!(s.len(), 2);
    assert_eq!(s.used_bytes(), 128);
    assert_eq!(s.load(&hash(2)).expect("load"), vec![8; 64]);
    let other = SpillStore::open(tmp.path(), "model-y", 1 << 20).expect("another model");
    assert!(other.is_empty(), "another model never sees these pages");
    // An index copied under the wrong model is refused, not trusted.
    fs::copy(s.dir().join("index.json"), other.dir().join("index.json")).expect("copy");
    assert!(matches!(SpillStore::open(tmp.path(), "model-y", 1 << 20), Err(SpillError::BadIndex { .. })));
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
    assert!(matches!(SpillStore::open(&file_as_root, "m", 10), Err(SpillError::Disk { .. })), "a file is no directory");
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
