//! `SpillStore`: evicted KV pages on disk, as plain data and synchronous file I/O (the spill I/O
//! thread runs it, never the async runtime). One self-describing file per page (`format`), in a
//! private directory per model fingerprint, with a per-directory secret that keys every page's
//! MAC (`secure`). The index is a checksummed cache of the pages' headers: when it is missing or
//! damaged it is rebuilt from the files themselves; files it does not know are adopted when their
//! header is valid and theirs, removed otherwise, with crash leftovers (`*.tmp`). A page is
//! written to a temp name, synced and renamed, so `kill -9` at any moment loses at most the page
//! being written. A page is only served when its length, header, every chunk's CRC-32 and its MAC
//! check out; anything else is a [`LoadError`]: the caller counts it and recomputes.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use super::format::{
    self, decode_index, encode_index, encode_page_prefix, first_bad_chunk, parse_page_prefix, IndexFile, PageHeader,
    CHUNK_BYTES, FORMAT_VERSION, KEY_BYTES, MAC_BYTES,
};
use super::secure::{self, ensure_private_dir, open_own_regular, Opened, KEY_FILE};
use crate::kv::PageHash;

/// The index file's name in a model's spill folder.
pub const INDEX_FILE: &str = "index.kvidx";
const PAGE_SUFFIX: &str = ".kvpage";
const TEMP_SUFFIX: &str = ".tmp";

#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("spill directory {path}: {source}")]
    Disk { path: String, source: io::Error },
    #[error("spill directory refused: {0}")]
    Refused(String),
}

/// Why a spilled page could not be served.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    #[error("page {0} is not in the spill index")]
    NotSpilled(String),
    #[error("spill file of page {0} is missing")]
    Missing(String),
    #[error("spill file of page {page} is {got} bytes, the index says {want}")]
    Short { page: String, got: u64, want: u64 },
    #[error("spill file of page {page}: chunk {chunk} fails its CRC-32")]
    Crc { page: String, chunk: usize },
    #[error("spill file of page {page}: bad header ({msg})")]
    Header { page: String, msg: String },
    #[error("spill file of page {0} fails its keyed MAC (rewritten by someone without the key)")]
    Tampered(String),
    #[error("spill path of page {page} is {what}; removed, not read")]
    NotRegular { page: String, what: String },
    #[error("spill file of page {page}: {msg}")]
    Io { page: String, msg: String },
    #[error("spill read of page {0} missed its deadline")]
    Deadline(String),
}

impl LoadError {
    /// Stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            LoadError::NotSpilled(_) => "not_spilled",
            LoadError::Missing(_) => "missing",
            LoadError::Short { .. } => "short",
            LoadError::Crc { .. } => "crc",
            LoadError::Header { .. } => "header",
            LoadError::Tampered(_) => "tampered",
            LoadError::NotRegular { .. } => "not_regular",
            LoadError::Io { .. } => "io",
            LoadError::Deadline(_) => "deadline",
        }
    }
}

/// A spilled page as the pool sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpilledPage {
    pub hash: PageHash,
    pub parent: Option<PageHash>,
}

/// What opening the directory found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// `Some(why)` when the index was missing or damaged and was rebuilt from the page files.
    pub rebuilt: Option<String>,
    /// Pages kept (from the index or adopted from their files).
    pub kept: usize,
    /// Page files whose header is damaged, truncated, or names another page, model or layout.
    pub damaged: usize,
    /// Symlinks, FIFOs and other entries that are not regular files of ours.
    pub not_regular: usize,
    /// Temp files a crash left behind.
    pub temp: usize,
    /// Files that are no part of a spill folder (including an older format's index).
    pub unknown: usize,
}

impl OpenReport {
    pub fn discarded(&self) -> [(&'static str, usize); 4] {
        [("damaged", self.damaged), ("not_regular", self.not_regular), ("temp", self.temp), ("unknown", self.unknown)]
    }
}

enum IndexProblem {
    /// No index: a fresh directory, or a crash before the first one was written.
    Absent,
    Damaged(String),
}

#[derive(Clone, Debug)]
struct Entry {
    header: PageHeader,
    file_len: u64,
}

impl Entry {
    fn new(header: PageHeader) -> Self {
        let json_len = serde_json::to_vec(&header).expect("a header serializes").len();
        Entry { file_len: header.file_len(json_len), header }
    }
}

pub struct SpillStore {
    dir: PathBuf,
    fingerprint: String,
    kv_layout: String,
    key: [u8; KEY_BYTES],
    budget: u64,
    used: u64,
    next_order: u64,
    entries: HashMap<PageHash, Entry>,
    index_dirty: bool,
    report: OpenReport,
}

fn parse_hash(s: &str) -> Option<PageHash> {
    if s.len() != 32 || !s.is_ascii() {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(PageHash(out))
}

/// Refuses a page header that names another page, model or KV layout.
fn check_header(fingerprint: &str, kv_layout: &str, hash: &PageHash, h: &PageHeader) -> Result<(), LoadError> {
    let page = hash.to_hex();
    let msg = if h.page != page {
        format!("it is page {}", h.page)
    } else if h.fingerprint != fingerprint {
        format!("it belongs to model {}", h.fingerprint)
    } else if h.kv_layout != kv_layout {
        format!("its KV layout is {}, not {kv_layout}", h.kv_layout)
    } else {
        return Ok(());
    };
    Err(LoadError::Header { page, msg })
}

/// Removes whatever is at `path` without following it.
fn remove_entry(path: &Path) {
    if let Err(e) = fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a spill directory entry");
        }
    }
}

impl SpillStore {
    /// Opens (or creates) the store for one model and KV layout under `root`. The directories
    /// must be ours and writable by nobody else (`SpillError::Refused` otherwise). A damaged or
    /// missing index is rebuilt from the files (see [`OpenReport`]). Index entries whose files are
    /// gone are kept: loading them reports `Missing`, honestly.
    pub fn open(root: &Path, fingerprint: &str, kv_layout: &str, budget: u64) -> Result<Self, SpillError> {
        if fingerprint.is_empty() || !fingerprint.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            return Err(SpillError::Refused(format!("model fingerprint `{fingerprint}` is not a folder name")));
        }
        // One folder per model and KV layout: engines on other devices sharing the directory
        // never see (nor discard) each other's pages.
        let layout: String =
            kv_layout.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
        let dir = root.join(format!("{fingerprint}.{layout}"));
        let checked = |d: &Path| {
            ensure_private_dir(d).map_err(|e| match e.kind() {
                io::ErrorKind::PermissionDenied => SpillError::Refused(e.to_string()),
                _ => SpillError::Disk { path: d.display().to_string(), source: e },
            })
        };
        checked(root)?;
        checked(&dir)?;
        let dir_name = dir.display().to_string();
        let disk = |source| SpillError::Disk { path: dir_name.clone(), source };
        let mut report = OpenReport::default();
        let (key, key_replaced) = match secure::load_or_create_key(&dir).map_err(disk)? {
            Some(k) => (k, false),
            None => {
                let k = secure::load_or_create_key(&dir)
                    .and_then(|k| k.ok_or_else(|| io::Error::other("no usable key")))
                    .map_err(disk)?;
                (k, true)
            }
        };
        if key_replaced {
            // Pages keyed with a secret we cannot trust cannot be verified: start afresh.
            report.rebuilt = Some("the directory's key was replaced".into());
        }
        let mut store = Self {
            dir,
            fingerprint: fingerprint.to_string(),
            kv_layout: kv_layout.to_string(),
            key,
            budget,
            used: 0,
            next_order: 0,
            entries: HashMap::new(),
            index_dirty: false,
            report,
        };
        let from_index = match store.read_index() {
            _ if key_replaced => None,
            Ok(pages) => Some(pages),
            Err(IndexProblem::Absent) => None,
            Err(IndexProblem::Damaged(why)) => {
                store.report.rebuilt = Some(why);
                None
            }
        };
        let had_index = from_index.is_some();
        store.index_dirty = !had_index;
        store.scan(from_index.unwrap_or_default(), key_replaced).map_err(disk)?;
        if !had_index && store.report.rebuilt.is_none() && !store.entries.is_empty() {
            store.report.rebuilt = Some("the index is missing".into());
        }
        store.report.kept = store.entries.len();
        store.flush_index()?;
        Ok(store)
    }

    /// The index's pages, or why it cannot be used.
    fn read_index(&self) -> Result<HashMap<PageHash, Entry>, IndexProblem> {
        self.read_index_inner()
            .map_err(|why| if why.is_empty() { IndexProblem::Absent } else { IndexProblem::Damaged(why) })
    }

    /// The index's pages, or why it cannot be used (empty: there is none).
    fn read_index_inner(&self) -> Result<HashMap<PageHash, Entry>, String> {
        let path = self.dir.join(INDEX_FILE);
        let mut f = match open_own_regular(&path) {
            Ok(Opened::File(f)) => f,
            Ok(Opened::Missing) => return Err(String::new()),
            Ok(Opened::NotRegular(what)) => {
                remove_entry(&path);
                return Err(format!("the index is {what}"));
            }
            Err(e) => return Err(format!("the index is unreadable: {e}")),
        };
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).map_err(|e| format!("the index is unreadable: {e}"))?;
        let index = decode_index(&bytes).map_err(|e| format!("the index is damaged: {e}"))?;
        if index.fingerprint != self.fingerprint || index.kv_layout != self.kv_layout {
            return Err(format!("the index is for {} / {}", index.fingerprint, index.kv_layout));
        }
        let mut out = HashMap::new();
        for h in index.pages {
            let Some(hash) = parse_hash(&h.page) else { return Err(format!("the index names page `{}`", h.page)) };
            out.insert(hash, Entry::new(h));
        }
        Ok(out)
    }

    /// Walks the folder: keeps what the index knows, adopts valid page files it does not, and
    /// removes everything else (counted in the report).
    /// With `discard_pages` (the key was replaced) no page file can be verified: all go.
    fn scan(&mut self, mut from_index: HashMap<PageHash, Entry>, discard_pages: bool) -> io::Result<()> {
        for item in fs::read_dir(&self.dir)? {
            let item = item?;
            let name = item.file_name();
            let path = item.path();
            let Some(name) = name.to_str() else {
                remove_entry(&path);
                self.report.unknown += 1;
                continue;
            };
            if name == KEY_FILE || name == INDEX_FILE {
                continue;
            }
            let file_type = item.file_type()?;
            if !file_type.is_file() {
                if !file_type.is_dir() {
                    remove_entry(&path);
                }
                self.report.not_regular += 1;
                continue;
            }
            if name.ends_with(TEMP_SUFFIX) {
                remove_entry(&path);
                self.report.temp += 1;
                continue;
            }
            let Some(hash) = name.strip_suffix(PAGE_SUFFIX).and_then(parse_hash) else {
                remove_entry(&path);
                self.report.unknown += 1;
                continue;
            };
            if discard_pages {
                remove_entry(&path);
                self.report.damaged += 1;
                continue;
            }
            if let Some(entry) = from_index.remove(&hash) {
                self.insert(hash, entry);
                continue;
            }
            match self.read_header(&hash) {
                Ok(entry) => {
                    self.index_dirty = true;
                    self.insert(hash, entry);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "discarding a spill file");
                    remove_entry(&path);
                    match e {
                        LoadError::NotRegular { .. } => self.report.not_regular += 1,
                        _ => self.report.damaged += 1,
                    }
                }
            }
        }
        // Indexed pages whose file is gone stay listed; a load reports them missing.
        for (hash, entry) in from_index {
            self.insert(hash, entry);
        }
        Ok(())
    }

    fn insert(&mut self, hash: PageHash, entry: Entry) {
        self.used += entry.file_len;
        self.next_order = self.next_order.max(entry.header.order + 1);
        self.entries.insert(hash, entry);
    }

    /// Reads and checks a page file's header (not its image): for adopting files at open.
    fn read_header(&self, hash: &PageHash) -> Result<Entry, LoadError> {
        let page = hash.to_hex();
        let path = self.page_path(hash);
        let io = |e: io::Error| LoadError::Io { page: page.clone(), msg: e.to_string() };
        let mut f = match open_own_regular(&path).map_err(io)? {
            Opened::File(f) => f,
            Opened::Missing => return Err(LoadError::Missing(page)),
            Opened::NotRegular(what) => return Err(LoadError::NotRegular { page, what }),
        };
        let size = f.metadata().map_err(io)?.len();
        let mut first = [0u8; 12];
        let bad = |msg: String| LoadError::Header { page: page.clone(), msg };
        f.read_exact(&mut first).map_err(|e| bad(e.to_string()))?;
        let n = format::header_json_len(&first).map_err(|e| bad(e.to_string()))?;
        let mut prefix = first.to_vec();
        prefix.resize(12 + n + 4 + MAC_BYTES, 0);
        f.read_exact(&mut prefix[12..]).map_err(|e| bad(e.to_string()))?;
        let parsed = parse_page_prefix(&prefix).map_err(|e| bad(e.to_string()))?;
        self.check_header(hash, &parsed.header)?;
        let entry = Entry::new(parsed.header);
        if entry.file_len != size {
            return Err(LoadError::Short { page, got: size, want: entry.file_len });
        }
        Ok(entry)
    }

    fn check_header(&self, hash: &PageHash, h: &PageHeader) -> Result<(), LoadError> {
        check_header(&self.fingerprint, &self.kv_layout, hash, h)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of page files (headers included) the store accounts for.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, hash: &PageHash) -> bool {
        self.entries.contains_key(hash)
    }

    /// What opening the directory found (for logs and metrics).
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    /// Every page the store holds (for the pool at startup).
    pub fn pages(&self) -> Vec<SpilledPage> {
        self.entries
            .iter()
            .map(|(h, e)| SpilledPage { hash: *h, parent: e.header.parent.as_deref().and_then(parse_hash) })
            .collect()
    }

    pub fn page_path(&self, hash: &PageHash) -> PathBuf {
        self.dir.join(format!("{}{PAGE_SUFFIX}", hash.to_hex()))
    }

    /// Writes a page's image. Older pages are dropped to stay within the budget; an image larger
    /// than the whole budget is not stored (`Ok(false)`). Returns the pages dropped for room.
    /// A disk error is returned as is: the caller turns spilling off. The index is brought up to
    /// date by [`flush_index`](Self::flush_index), which the I/O thread calls when idle.
    pub fn store(
        &mut self,
        hash: PageHash,
        parent: Option<PageHash>,
        image: &[u8],
    ) -> Result<(bool, Vec<PageHash>), SpillError> {
        if self.entries.contains_key(&hash) {
            return Ok((true, Vec::new()));
        }
        let header = PageHeader {
            version: FORMAT_VERSION,
            page: hash.to_hex(),
            parent: parent.map(|p| p.to_hex()),
            fingerprint: self.fingerprint.clone(),
            kv_layout: self.kv_layout.clone(),
            len: image.len() as u64,
            chunk_bytes: CHUNK_BYTES as u64,
            crcs: format::crcs_of(image),
            order: self.next_order,
        };
        let entry = Entry::new(header);
        if entry.file_len > self.budget {
            return Ok((false, Vec::new()));
        }
        let mut dropped = Vec::new();
        while self.used + entry.file_len > self.budget {
            let Some(oldest) = self.entries.iter().min_by_key(|(_, e)| e.header.order).map(|(h, _)| *h) else { break };
            self.remove(&oldest);
            dropped.push(oldest);
        }
        let path = self.page_path(&hash);
        let tmp = self.dir.join(format!("{}{PAGE_SUFFIX}{TEMP_SUFFIX}", hash.to_hex()));
        let disk = |source| SpillError::Disk { path: path.display().to_string(), source };
        // A leftover of a crash (or anything planted) at the temp name: unlinked, never followed.
        remove_entry(&tmp);
        let prefix = encode_page_prefix(&self.key, &entry.header, image);
        let written = secure::create_new_private(&tmp).and_then(|mut f| {
            f.write_all(&prefix)?;
            f.write_all(image)?;
            f.sync_data()
        });
        // The rename replaces whatever is at the page path (a planted link included) without
        // following it.
        if let Err(e) = written.and_then(|_| fs::rename(&tmp, &path)) {
            remove_entry(&tmp);
            return Err(disk(e));
        }
        self.next_order += 1;
        self.insert(hash, entry);
        self.index_dirty = true;
        Ok((true, dropped))
    }

    /// Reads a page back, checking its file type and owner, length, header, every chunk's CRC-32
    /// and its keyed MAC. On any failure the entry and whatever is at its path are removed (it
    /// will never be served) and the reason is returned.
    pub fn load(&mut self, hash: &PageHash) -> Result<Vec<u8>, LoadError> {
        let result = self.page_read(hash)?.run();
        if result.is_err() {
            self.remove(hash);
        }
        result
    }

    /// Everything one read of `hash` needs, detached from the store so that reads can run on
    /// other threads (`PageRead::run`). `NotSpilled` when the store does not hold the page.
    pub fn page_read(&self, hash: &PageHash) -> Result<PageRead, LoadError> {
        let entry = self.entries.get(hash).cloned().ok_or_else(|| LoadError::NotSpilled(hash.to_hex()))?;
        Ok(PageRead {
            hash: *hash,
            path: self.page_path(hash),
            entry,
            key: self.key,
            fingerprint: self.fingerprint.clone(),
            kv_layout: self.kv_layout.clone(),
        })
    }

    /// A detached read of `hash` failed (and removed whatever was at its path): drop its entry.
    pub fn forget_failed(&mut self, hash: &PageHash) {
        self.remove(hash);
    }
}

/// One page read, detached from the store (see [`SpillStore::page_read`]).
#[derive(Clone)]
pub struct PageRead {
    hash: PageHash,
    path: PathBuf,
    entry: Entry,
    key: [u8; KEY_BYTES],
    fingerprint: String,
    kv_layout: String,
}

impl PageRead {
    pub fn hash(&self) -> PageHash {
        self.hash
    }

    /// Reads the page, checking its file type and owner, length, header, every chunk's CRC-32
    /// and its keyed MAC. On a failure whatever is at the path is removed (it will never be
    /// served; the store's entry must be dropped too: `SpillStore::forget_failed`).
    pub fn run(&self) -> Result<Vec<u8>, LoadError> {
        let result = self.read_checked();
        if result.is_err() {
            remove_entry(&self.path);
        }
        result
    }

    fn read_checked(&self) -> Result<Vec<u8>, LoadError> {
        let (hash, entry) = (&self.hash, &self.entry);
        let page = hash.to_hex();
        let io = |e: io::Error| LoadError::Io { page: page.clone(), msg: e.to_string() };
        let mut f = match open_own_regular(&self.path).map_err(io)? {
            Opened::File(f) => f,
            Opened::Missing => return Err(LoadError::Missing(page)),
            Opened::NotRegular(what) => return Err(LoadError::NotRegular { page, what }),
        };
        let got = f.metadata().map_err(io)?.len();
        if got != entry.file_len {
            return Err(LoadError::Short { page, got, want: entry.file_len });
        }
        let mut bytes = vec![0u8; got as usize];
        f.read_exact(&mut bytes).map_err(io)?;
        let parsed =
            parse_page_prefix(&bytes).map_err(|e| LoadError::Header { page: page.clone(), msg: e.to_string() })?;
        check_header(&self.fingerprint, &self.kv_layout, hash, &parsed.header)?;
        if parsed.header != entry.header || parsed.image_at as u64 + parsed.header.len != got {
            return Err(LoadError::Header { page, msg: "it differs from the index".into() });
        }
        let image = &bytes[parsed.image_at..];
        if let Some(chunk) = first_bad_chunk(&parsed.header, image) {
            return Err(LoadError::Crc { page, chunk });
        }
        if !format::mac_matches(&self.key, &parsed.header_json, image, &bytes[parsed.mac_at..parsed.image_at]) {
            return Err(LoadError::Tampered(page));
        }
        Ok(bytes.split_off(parsed.image_at))
    }
}

impl SpillStore {
    fn remove(&mut self, hash: &PageHash) {
        if let Some(e) = self.entries.remove(hash) {
            self.used -= e.file_len;
            remove_entry(&self.page_path(hash));
            self.index_dirty = true;
        }
    }

    /// Rewrites the index if pages came or went since the last write: temp file (0600, created
    /// new, never through a link), synced, renamed. A crash before the rename leaves the old
    /// index, which the next open reconciles with the files.
    pub fn flush_index(&mut self) -> Result<(), SpillError> {
        if !self.index_dirty {
            return Ok(());
        }
        let mut pages: Vec<PageHeader> = self.entries.values().map(|e| e.header.clone()).collect();
        pages.sort_by_key(|h| h.order);
        let file = IndexFile {
            version: FORMAT_VERSION,
            fingerprint: self.fingerprint.clone(),
            kv_layout: self.kv_layout.clone(),
            pages,
        };
        let path = self.dir.join(INDEX_FILE);
        let tmp = self.dir.join(format!("{INDEX_FILE}{TEMP_SUFFIX}"));
        let disk = |source| SpillError::Disk { path: path.display().to_string(), source };
        remove_entry(&tmp);
        let written = secure::create_new_private(&tmp).and_then(|mut f| {
            f.write_all(&encode_index(&file))?;
            f.sync_data()
        });
        if let Err(e) = written.and_then(|_| fs::rename(&tmp, &path)) {
            remove_entry(&tmp);
            return Err(disk(e));
        }
        self.index_dirty = false;
        Ok(())
    }

    /// Makes every write so far durable: the index, then the directory (renames, unlinks).
    pub fn sync(&mut self) -> Result<(), SpillError> {
        self.flush_index()?;
        secure::sync_dir(&self.dir).map_err(|source| SpillError::Disk { path: self.dir.display().to_string(), source })
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
