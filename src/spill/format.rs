//! The bytes of a page file and of the index, as pure functions (no file I/O).
//!
//! A page file describes itself, so the index is only a cache that can be rebuilt from the files:
//!
//! ```text
//! "SSKVPG02" | header length (u32 LE) | header (JSON) | CRC-32 of the three before (u32 LE)
//!            | HMAC-SHA256(key, header || image) (32 bytes) | image
//! ```
//!
//! The header names the format version, the page and its parent, the model fingerprint, the KV
//! layout, the image length and a CRC-32 per 8 MiB chunk. CRCs find accidents (a torn write, a
//! flipped bit) and say which chunk; the keyed MAC finds intent: a page rewritten with matching
//! CRCs by someone without the directory's secret fails it. The MAC covers the header, so a valid
//! file copied to another page's name is caught too (its header names the other page).
//!
//! The index is `"SSKVIX02" | CRC-32 of the JSON (u32 LE) | JSON`, the JSON holding the
//! fingerprint, the layout and every page's header.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

/// Format version written in every header (the magic carries it too).
pub const FORMAT_VERSION: u32 = 2;
/// Bytes covered by one CRC-32.
pub const CHUNK_BYTES: usize = 8 << 20;
/// Bytes of the keyed MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;
/// Bytes of the per-directory secret.
pub const KEY_BYTES: usize = 32;

const PAGE_MAGIC: &[u8; 8] = b"SSKVPG02";
const INDEX_MAGIC: &[u8; 8] = b"SSKVIX02";
/// A header is a few hundred bytes plus 4 bytes of CRC per 8 MiB; anything this large is damage.
const MAX_HEADER_BYTES: usize = 1 << 20;

/// What a page file says about itself (and what the index caches).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct PageHeader {
    pub version: u32,
    /// The page's hash, hex.
    pub page: String,
    pub parent: Option<String>,
    pub fingerprint: String,
    pub kv_layout: String,
    /// Bytes of the image that follows the MAC.
    pub len: u64,
    pub chunk_bytes: u64,
    pub crcs: Vec<u32>,
    /// Write order: the oldest page goes first when the budget is exceeded.
    pub order: u64,
}

impl PageHeader {
    /// Bytes of the whole file: prefix, header, CRC, MAC and image.
    pub fn file_len(&self, header_bytes: usize) -> u64 {
        (PAGE_MAGIC.len() + 4 + header_bytes + 4 + MAC_BYTES) as u64 + self.len
    }
}

/// Why bytes are not a valid page file or index.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    #[error("too short for its header")]
    Truncated,
    #[error("not a page file of this format (magic)")]
    Magic,
    #[error("header fails its CRC-32")]
    HeaderCrc,
    #[error("header is not valid: {0}")]
    Header(String),
    #[error("format version {0} is not {FORMAT_VERSION}")]
    Version(u32),
}

pub fn crcs_of(image: &[u8]) -> Vec<u32> {
    image.chunks(CHUNK_BYTES).map(crc32fast::hash).collect()
}

fn mac_of(key: &[u8; KEY_BYTES], header: &[u8], image: &[u8]) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(header);
    mac.update(image);
    mac
}

/// Everything of a page file that precedes the image.
pub fn encode_page_prefix(key: &[u8; KEY_BYTES], header: &PageHeader, image: &[u8]) -> Vec<u8> {
    let json = serde_json::to_vec(header).expect("a header serializes");
    let mut out = Vec::with_capacity(json.len() + 48);
    out.extend_from_slice(PAGE_MAGIC);
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&mac_of(key, &json, image).finalize().into_bytes());
    out
}

/// A parsed page file prefix: the header, its JSON bytes (what the MAC covers) and where the MAC
/// and the image start.
#[derive(Debug)]
pub struct ParsedPrefix {
    pub header: PageHeader,
    pub header_json: Vec<u8>,
    pub mac_at: usize,
    pub image_at: usize,
}

/// Length of the JSON header, from the first 12 bytes of a file.
pub fn header_json_len(first12: &[u8]) -> Result<usize, FormatError> {
    if first12.len() < 12 {
        return Err(FormatError::Truncated);
    }
    if &first12[..8] != PAGE_MAGIC {
        return Err(FormatError::Magic);
    }
    let n = u32::from_le_bytes(first12[8..12].try_into().expect("4 bytes")) as usize;
    if n > MAX_HEADER_BYTES {
        return Err(FormatError::Header(format!("{n}-byte header")));
    }
    Ok(n)
}

/// Parses and checks (magic, CRC, version) the header at the start of `bytes`, which must hold at
/// least the prefix (the image may follow or not).
pub fn parse_page_prefix(bytes: &[u8]) -> Result<ParsedPrefix, FormatError> {
    let n = header_json_len(bytes)?;
    let crc_at = 12 + n;
    let mac_at = crc_at + 4;
    let image_at = mac_at + MAC_BYTES;
    if bytes.len() < image_at {
        return Err(FormatError::Truncated);
    }
    let crc = u32::from_le_bytes(bytes[crc_at..mac_at].try_into().expect("4 bytes"));
    if crc32fast::hash(&bytes[..crc_at]) != crc {
        return Err(FormatError::HeaderCrc);
    }
    let header_json = bytes[12..crc_at].to_vec();
    let header: PageHeader = serde_json::from_slice(&header_json).map_err(|e| FormatError::Header(e.to_string()))?;
    if header.version != FORMAT_VERSION {
        return Err(FormatError::Version(header.version));
    }
    if header.chunk_bytes != CHUNK_BYTES as u64 || header.crcs.len() != (header.len as usize).div_ceil(CHUNK_BYTES) {
        return Err(FormatError::Header("chunking does not match the length".into()));
    }
    Ok(ParsedPrefix { header, header_json, mac_at, image_at })
}

/// The first chunk whose CRC-32 differs from the header's.
pub fn first_bad_chunk(header: &PageHeader, image: &[u8]) -> Option<usize> {
    let crcs = crcs_of(image);
    if crcs.len() != header.crcs.len() {
        return Some(crcs.len().min(header.crcs.len()));
    }
    crcs.iter().zip(&header.crcs).position(|(a, b)| a != b)
}

/// Checks the keyed MAC of a page (constant-time comparison).
pub fn mac_matches(key: &[u8; KEY_BYTES], header_json: &[u8], image: &[u8], mac: &[u8]) -> bool {
    mac_of(key, header_json, image).verify_slice(mac).is_ok()
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct IndexFile {
    pub version: u32,
    pub fingerprint: String,
    pub kv_layout: String,
    pub pages: Vec<PageHeader>,
}

pub fn encode_index(index: &IndexFile) -> Vec<u8> {
    let json = serde_json::to_vec(index).expect("an index serializes");
    let mut out = Vec::with_capacity(json.len() + 12);
    out.extend_from_slice(INDEX_MAGIC);
    out.extend_from_slice(&crc32fast::hash(&json).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

pub fn decode_index(bytes: &[u8]) -> Result<IndexFile, FormatError> {
    if bytes.len() < 12 {
        return Err(FormatError::Truncated);
    }
    if &bytes[..8] != INDEX_MAGIC {
        return Err(FormatError::Magic);
    }
    let crc = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if crc32fast::hash(&bytes[12..]) != crc {
        return Err(FormatError::HeaderCrc);
    }
    let index: IndexFile = serde_json::from_slice(&bytes[12..]).map_err(|e| FormatError::Header(e.to_string()))?;
    if index.version != FORMAT_VERSION {
        return Err(FormatError::Version(index.version));
    }
    Ok(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(image: &[u8]) -> PageHeader {
        PageHeader {
            version: FORMAT_VERSION,
            page: "ab".repeat(16),
            parent: None,
            fingerprint: "m".into(),
            kv_layout: "cpu/block16".into(),
            len: image.len() as u64,
            chunk_bytes: CHUNK_BYTES as u64,
            crcs: crcs_of(image),
            order: 7,
        }
    }

    #[test]
    fn a_page_prefix_round_trips_and_its_mac_binds_header_and_image() {
        let key = [9u8; KEY_BYTES];
        let image = vec![5u8; 1000];
        let h = header(&image);
        let prefix = encode_page_prefix(&key, &h, &image);
        let p = parse_page_prefix(&prefix).expect("parse");
        assert_eq!(p.header, h);
        assert_eq!(p.image_at, prefix.len());
        assert_eq!(h.file_len(p.header_json.len()), (prefix.len() + image.len()) as u64);
        let mac = &prefix[p.mac_at..p.image_at];
        assert!(mac_matches(&key, &p.header_json, &image, mac));
        let mut other = image.clone();
        other[3] ^= 1;
        assert!(!mac_matches(&key, &p.header_json, &other, mac), "the image is covered");
        assert!(!mac_matches(&[8u8; KEY_BYTES], &p.header_json, &image, mac), "the key matters");
        assert_eq!(first_bad_chunk(&h, &other), Some(0));
        assert_eq!(first_bad_chunk(&h, &image), None);
    }

    #[test]
    fn every_damaged_prefix_byte_is_refused() {
        let key = [1u8; KEY_BYTES];
        let image = vec![1u8; 10];
        let prefix = encode_page_prefix(&key, &header(&image), &image);
        let mac_at = parse_page_prefix(&prefix).expect("parse").mac_at;
        for i in 0..mac_at {
            let mut bad = prefix.clone();
            bad[i] ^= 0x10;
            assert!(parse_page_prefix(&bad).is_err(), "byte {i} flipped");
        }
        assert_eq!(parse_page_prefix(&prefix[..mac_at]).unwrap_err(), FormatError::Truncated);
    }

    #[test]
    fn the_index_is_checksummed() {
        let image = vec![1u8; 10];
        let index = IndexFile {
            version: FORMAT_VERSION,
            fingerprint: "m".into(),
            kv_layout: "l".into(),
            pages: vec![header(&image)],
        };
        let bytes = encode_index(&index);
        assert_eq!(decode_index(&bytes).expect("decode"), index);
        let mut bad = bytes.clone();
        let last = bad.len() - 2;
        bad[last] ^= 1;
        assert_eq!(decode_index(&bad).unwrap_err(), FormatError::HeaderCrc);
        assert_eq!(decode_index(&bytes[..5]).unwrap_err(), FormatError::Truncated);
    }
}
