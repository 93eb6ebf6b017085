//! Page identity and lookup outcomes: what names a cached page (a hash chain over token ids,
//! salted with the model fingerprint, KV layout and rank) and why a lookup missed. Plain data,
//! shared by the pool, the spill tier and metrics.

use sha2::{Digest, Sha256};

/// Identity of a page: the first 16 bytes of a SHA-256 over the parent page's identity, the page's
/// token ids and the pool salt (model fingerprint, KV layout, rank). Stable across restarts, so the
/// spill index can key files by it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct PageHash(pub [u8; 16]);

impl PageHash {
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// What makes a cached page valid for a lookup besides its tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolIdentity {
    /// Identifies the weights (e.g. a hash of the model file); pages never cross models.
    pub model_fingerprint: String,
    /// KV dtype and memory layout as the backend writes them (e.g. `f32/blocks16`).
    pub kv_layout: String,
    /// Tensor-parallel rank whose shard of the KV the blocks hold.
    pub rank: u32,
}

/// An image in a sequence's tokens, for page identities: its placeholder positions and its
/// content hash.
pub type ImageKey = (std::ops::Range<usize>, u64);

/// Computes page identities for one pool identity.
#[derive(Clone, Debug)]
pub struct PageHasher {
    salt: [u8; 32],
}

impl PageHasher {
    pub fn new(id: &PoolIdentity) -> Self {
        let mut h = Sha256::new();
        for part in [id.model_fingerprint.as_bytes(), id.kv_layout.as_bytes()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
        h.update(id.rank.to_le_bytes());
        Self { salt: h.finalize().into() }
    }

    /// Identity of the page holding `tokens` whose predecessor is `parent` (`None` for the first).
    pub fn page(&self, parent: Option<PageHash>, tokens: &[u32]) -> PageHash {
        let mut h = Sha256::new();
        h.update(self.salt);
        h.update(parent.map_or([0xff; 16], |p| p.0));
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let digest = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        PageHash(out)
    }

    /// Identity of a page whose token rows `images` cover: `(first row in the page, rows,
    /// content hash)` per image span inside it. Image placeholder tokens are the same id for
    /// every image, so the images' content must be part of the identity or two different
    /// pictures at the same positions would share cached KV. With no images this is
    /// [`Self::page`], so text-only pages keep their identity (and their spilled files).
    pub fn page_with_media(
        &self,
        parent: Option<PageHash>,
        tokens: &[u32],
        images: &[(usize, usize, u64)],
    ) -> PageHash {
        if images.is_empty() {
            return self.page(parent, tokens);
        }
        let mut h = Sha256::new();
        h.update(self.page(parent, tokens).0);
        h.update(b"images");
        for &(first, rows, content) in images {
            h.update((first as u64).to_le_bytes());
            h.update((rows as u64).to_le_bytes());
            h.update(content.to_le_bytes());
        }
        let digest = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        PageHash(out)
    }

    /// Identity of page `index` (tokens `index·page_tokens..`) of a sequence whose `tokens` hold
    /// image placeholders at `images` (each image's span of positions and its content hash,
    /// `media::content_hash`, in any order), given its parent's identity.
    pub fn page_at(
        &self,
        parent: Option<PageHash>,
        tokens: &[u32],
        index: usize,
        page_tokens: usize,
        images: &[ImageKey],
    ) -> PageHash {
        let (lo, hi) = (index * page_tokens, (index + 1) * page_tokens);
        let page = &tokens[lo..hi];
        if images.is_empty() {
            return self.page(parent, page);
        }
        let inside: Vec<(usize, usize, u64)> = images
            .iter()
            .filter(|(r, _)| r.start < hi && r.end > lo)
            .map(|(r, c)| {
                let (a, b) = (r.start.max(lo), r.end.min(hi));
                // The offset of the page's part within the image too: a page boundary that cuts
                // an image elsewhere holds different rows of it.
                (a - lo, b - a, c ^ ((a - r.start) as u64).rotate_left(32))
            })
            .collect();
        self.page_with_media(parent, page, &inside)
    }

    /// [`Self::chain`] for a prompt with images (see [`Self::page_at`]).
    pub fn chain_with_media(&self, tokens: &[u32], page_tokens: usize, images: &[ImageKey]) -> Vec<PageHash> {
        if page_tokens == 0 {
            return Vec::new();
        }
        let mut parent = None;
        (0..tokens.len() / page_tokens)
            .map(|i| {
                let h = self.page_at(parent, tokens, i, page_tokens, images);
                parent = Some(h);
                h
            })
            .collect()
    }

    /// Identities of every whole page of `tokens`, in order.
    pub fn chain(&self, tokens: &[u32], page_tokens: usize) -> Vec<PageHash> {
        let mut parent = None;
        tokens
            .chunks_exact(page_tokens)
            .map(|page| {
                let h = self.page(parent, page);
                parent = Some(h);
                h
            })
            .collect()
    }
}

/// Why a lookup did not serve every token it could have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MissReason {
    /// The first missing page was never cached (or was forgotten long ago).
    NoEntry,
    /// The first missing page was cached but evicted from memory (and not restorable from disk).
    Evicted,
    /// The first missing page was spilled, but its file failed the CRC, was short or was gone.
    SpilledCorrupt,
    /// Every whole page was served; what is left is shorter than a page.
    TailShorterThanPage,
}

impl MissReason {
    pub const ALL: [MissReason; 4] =
        [MissReason::NoEntry, MissReason::Evicted, MissReason::SpilledCorrupt, MissReason::TailShorterThanPage];

    /// Stable label for metrics.
    pub fn label(self) -> &'static str {
        match self {
            MissReason::NoEntry => "no_entry",
            MissReason::Evicted => "evicted",
            MissReason::SpilledCorrupt => "spilled_corrupt",
            MissReason::TailShorterThanPage => "tail_shorter_than_page",
        }
    }
}

/// Result of a prefix lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixHit {
    /// Pages served (a multiple of `page_tokens` tokens).
    pub pages: usize,
    pub hit_tokens: usize,
    pub miss: Option<MissReason>,
}
