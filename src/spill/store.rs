//! `SpillStore`: evicted KV pages on disk, as plain data and synchronous file I/O (the
//! `SpillActor` runs it off the async runtime). One file per page, created 0600 in a directory
//! per model fingerprint (0700), holding the page's image (attention KV blocks followed by the
//! recurrent-state snapshot). The index (`index.json`, rewritten atomically) records for each page
//! its parent, length and a CRC-32 per 8 MiB chunk, so it survives a restart and a page is only
//! ever served if every chunk checks out. Anything else — CRC mismatch, short file, missing file,
//! unreadable file — is a [`LoadError`]: the caller counts it and recomputes.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::kv::PageHash;

/// Bytes covered by one CRC-32.
pub const CHUNK_BYTES: usize = 8 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("spill directory {path}: {source}")]
    Disk { path: String, source: std::io::Error },
    #[error("spill index {path} is unreadable: {msg}")]
    BadIndex { path: String, msg: String },
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
    #[error("spill file of page {page}: {msg}")]
    Io { page: String, msg: String },
}

impl LoadError {
    /// Stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            LoadError::NotSpilled(_) => "not_spilled",
            LoadError::Missing(_) => "missing",
            LoadError::Short { .. } => "short",
            LoadError::Crc { .. } => "crc",
            LoadError::Io { .. } => "io",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Entry {
    parent: Option<String>,
    len: u64,
    crcs: Vec<u32>,
    /// Insertion order: the oldest page goes first when the budget is exceeded.
    order: u64,
}

#[derive(Debug, Serialize, Deserialize)]
struct IndexFile {
    fingerprint: String,
    entries: BTreeMap<String, Entry>,
}

/// A spilled page as the pool sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpilledPage {
    pub hash: PageHash,
    pub parent: Option<PageHash>,
}

pub struct SpillStore {
    dir: PathBuf,
    fingerprint: String,
    budget: u64,
    used: u64,
    next_order: u64,
    entries: HashMap<PageHash, Entry>,
}

fn parse_hash(s: &str) -> Option<PageHash> {
    if s.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(PageHash(out))
}

fn crcs_of(image: &[u8]) -> Vec<u32> {
    image.chunks(CHUNK_BYTES).map(crc32fast::hash).collect()
}

impl SpillStore {
    /// Opens (or creates) the store for one model under `root`, loading the index a previous run
    /// left. Entries whose files are gone are kept: loading them reports `Missing`, honestly.
    pub fn open(root: &Path, fingerprint: &str, budget: u64) -> Result<Self, SpillError> {
        let dir = root.join(fingerprint);
        let disk = |source| SpillError::Disk { path: dir.display().to_string(), source };
        fs::create_dir_all(&dir).map_err(disk)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(disk)?;
        }
        let mut store =
            Self { dir, fingerprint: fingerprint.to_string(), budget, used: 0, next_order: 0, entries: HashMap::new() };
        let index = store.index_path();
        match fs::read(&index) {
            Ok(bytes) => {
                let file: IndexFile = serde_json::from_slice(&bytes)
                    .map_err(|e| SpillError::BadIndex { path: index.display().to_string(), msg: e.to_string() })?;
                if file.fingerprint != fingerprint {
                    return Err(SpillError::BadIndex {
                        path: index.display().to_string(),
                        msg: format!("it belongs to model {}, not {fingerprint}", file.fingerprint),
                    });
                }
                for (k, e) in file.entries {
                    if let Some(h) = parse_hash(&k) {
                        store.used += e.len;
                        store.next_order = store.next_order.max(e.order + 1);
                        store.entries.insert(h, e);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(SpillError::Disk { path: index.display().to_string(), source: e }),
        }
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of page files the index accounts for.
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

    /// Every page in the index (for the pool at startup).
    pub fn pages(&self) -> Vec<SpilledPage> {
        self.entries
            .iter()
            .map(|(h, e)| SpilledPage { hash: *h, parent: e.parent.as_deref().and_then(parse_hash) })
            .collect()
    }

    pub fn page_path(&self, hash: &PageHash) -> PathBuf {
        self.dir.join(format!("{}.kvpage", hash.to_hex()))
    }

    fn index_path(&self) -> PathBuf {
        self.dir.join("index.json")
    }

    /// Writes a page's image. Older pages are dropped to stay within the budget; an image larger
    /// than the whole budget is not stored (`Ok(false)`). Returns the pages dropped for room.
    /// A disk error is returned as is: the caller turns spilling off.
    pub fn store(
        &mut self,
        hash: PageHash,
        parent: Option<PageHash>,
        image: &[u8],
    ) -> Result<(bool, Vec<PageHash>), SpillError> {
        let len = image.len() as u64;
        if self.entries.contains_key(&hash) {
            return Ok((true, Vec::new()));
        }
        if len > self.budget {
            return Ok((false, Vec::new()));
        }
        let mut dropped = Vec::new();
        while self.used + len > self.budget {
            let Some(oldest) = self.entries.iter().min_by_key(|(_, e)| e.order).map(|(h, _)| *h) else { break };
            self.remove(&oldest);
            dropped.push(oldest);
        }
        let path = self.page_path(&hash);
        let disk = |source| SpillError::Disk { path: path.display().to_string(), source };
        let mut opts = OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let mut f = opts.open(&path).map_err(disk)?;
        let written = f.write_all(image).and_then(|_| f.sync_data());
        if let Err(e) = written {
            let _ = fs::remove_file(&path);
            return Err(disk(e));
        }
        let order = self.next_order;
        self.next_order += 1;
        self.entries.insert(hash, Entry { parent: parent.map(|p| p.to_hex()), len, crcs: crcs_of(image), order });
        self.used += len;
        self.save_index()?;
        Ok((true, dropped))
    }

    /// Reads a page back, checking its length and every chunk's CRC-32. On any failure the entry
    /// and its file are removed (it will never be served) and the reason is returned.
    pub fn load(&mut self, hash: &PageHash) -> Result<Vec<u8>, LoadError> {
        let page = hash.to_hex();
        let entry = self.entries.get(hash).cloned().ok_or_else(|| LoadError::NotSpilled(page.clone()))?;
        let result = self.read_checked(hash, &entry);
        if result.is_err() {
            self.remove(hash);
            let _ = self.save_index();
        }
        result
    }

    fn read_checked(&self, hash: &PageHash, entry: &Entry) -> Result<Vec<u8>, LoadError> {
        let page = hash.to_hex();
        let io = |e: std::io::Error| LoadError::Io { page: page.clone(), msg: e.to_string() };
        let mut f = match File::open(self.page_path(hash)) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(LoadError::Missing(page)),
            Err(e) => return Err(io(e)),
        };
        let got = f.metadata().map_err(io)?.len();
        if got != entry.len {
            return Err(LoadError::Short { page, got, want: entry.len });
        }
        let mut image = vec![0u8; entry.len as usize];
        f.read_exact(&mut image).map_err(io)?;
        let crcs = crcs_of(&image);
        if crcs.len() != entry.crcs.len() {
            return Err(LoadError::Crc { page, chunk: crcs.len().min(entry.crcs.len()) });
        }
        if let Some(chunk) = crcs.iter().zip(&entry.crcs).position(|(a, b)| a != b) {
            return Err(LoadError::Crc { page, chunk });
        }
        Ok(image)
    }

    fn remove(&mut self, hash: &PageHash) {
        if let Some(e) = self.entries.remove(hash) {
            self.used -= e.len;
            let _ = fs::remove_file(self.page_path(hash));
        }
    }

    /// Rewrites the index atomically (temporary file, then rename).
    fn save_index(&self) -> Result<(), SpillError> {
        let file = IndexFile {
            fingerprint: self.fingerprint.clone(),
            entries: self.entries.iter().map(|(h, e)| (h.to_hex(), e.clone())).collect(),
        };
        let path = self.index_path();
        let tmp = self.dir.join("index.json.tmp");
        let disk = |source| SpillError::Disk { path: path.display().to_string(), source };
        let bytes = serde_json::to_vec(&file).map_err(|e| disk(std::io::Error::other(e)))?;
        let mut opts = OpenOptions::new();
        opts.write(true).create(true).truncate(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            opts.mode(0o600);
        }
        let mut f = opts.open(&tmp).map_err(disk)?;
        f.write_all(&bytes).and_then(|_| f.sync_data()).map_err(disk)?;
        fs::rename(&tmp, &path).map_err(disk)
    }
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
