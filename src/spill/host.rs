//! The host-memory tier in front of the disk: the images of recently evicted pages, kept in
//! process memory up to a byte budget, least recently used out first. A restore it can serve is a
//! copy to the device (no file read, no checksum: the bytes never left the process); the disk
//! copy is written all the same, so a page dropped here is still restorable from there.
//!
//! Plain data: the spill actor owns it and tells the pool which pages it holds.

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

use crate::kv::PageHash;

/// The configured budget, capped at a quarter of the host memory available at startup (where it
/// can be read), so the tier never crowds out the rest of the host.
pub fn budget(configured: u64, available: Option<u64>) -> u64 {
    available.map_or(configured, |a| configured.min(a / 4))
}

#[derive(Debug, Default)]
pub struct HostTier {
    budget: u64,
    used: u64,
    tick: u64,
    pages: HashMap<PageHash, (u64, Bytes)>,
    /// Use tick → page, oldest first.
    order: BTreeMap<u64, PageHash>,
}

impl HostTier {
    pub fn new(budget: u64) -> Self {
        HostTier { budget, ..Default::default() }
    }

    pub fn is_on(&self) -> bool {
        self.budget > 0
    }

    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.pages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    pub fn contains(&self, hash: &PageHash) -> bool {
        self.pages.contains_key(hash)
    }

    /// Keeps `image` (a cheap reference to the same bytes), dropping the least recently used
    /// pages to make room. Returns whether it was kept (an image over the whole budget is not)
    /// and the pages dropped for it.
    pub fn insert(&mut self, hash: PageHash, image: Bytes) -> (bool, Vec<PageHash>) {
        let size = image.len() as u64;
        if size > self.budget {
            return (false, Vec::new());
        }
        self.remove(&hash);
        let mut dropped = Vec::new();
        while self.used + size > self.budget {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            if let Some((_, img)) = self.pages.remove(&oldest) {
                self.used -= img.len() as u64;
                dropped.push(oldest);
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, hash);
        self.pages.insert(hash, (self.tick, image));
        self.used += size;
        (true, dropped)
    }

    /// The page's image, now the most recently used.
    pub fn get(&mut self, hash: &PageHash) -> Option<Bytes> {
        let (tick, image) = self.pages.get_mut(hash)?;
        self.order.remove(tick);
        self.tick += 1;
        *tick = self.tick;
        self.order.insert(self.tick, *hash);
        Some(image.clone())
    }

    pub fn remove(&mut self, hash: &PageHash) -> bool {
        match self.pages.remove(hash) {
            Some((tick, image)) => {
                self.order.remove(&tick);
                self.used -= image.len() as u64;
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(n: u8) -> PageHash {
        PageHash([n; 16])
    }

    #[test]
    fn least_recently_used_pages_go_first_and_the_budget_holds() {
        let mut t = HostTier::new(300);
        assert_eq!(t.insert(page(1), Bytes::from(vec![1u8; 100])), (true, vec![]));
        assert_eq!(t.insert(page(2), Bytes::from(vec![2u8; 100])), (true, vec![]));
        assert_eq!(t.insert(page(3), Bytes::from(vec![3u8; 100])), (true, vec![]));
        // Using page 1 makes page 2 the oldest.
        assert_eq!(t.get(&page(1)).unwrap()[0], 1);
        assert_eq!(t.insert(page(4), Bytes::from(vec![4u8; 150])), (true, vec![page(2), page(3)]));
        assert_eq!(t.used_bytes(), 250);
        assert!(t.contains(&page(1)) && t.contains(&page(4)) && !t.contains(&page(2)));
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn an_image_over_the_budget_is_not_kept_and_a_zero_budget_is_off() {
        let mut t = HostTier::new(100);
        assert_eq!(t.insert(page(1), Bytes::from(vec![0u8; 101])), (false, vec![]));
        assert!(t.is_empty());
        let mut off = HostTier::new(0);
        assert!(!off.is_on());
        assert_eq!(off.insert(page(1), Bytes::from(vec![0u8; 1])), (false, vec![]));
    }

    #[test]
    fn the_budget_is_capped_at_a_quarter_of_available_memory() {
        assert_eq!(budget(16 << 30, Some(128 << 30)), 16 << 30);
        assert_eq!(budget(16 << 30, Some(24 << 30)), 6 << 30);
        assert_eq!(budget(16 << 30, None), 16 << 30);
        assert_eq!(budget(0, Some(128 << 30)), 0);
    }

    #[test]
    fn reinserting_a_page_replaces_it_and_removing_frees_its_bytes() {
        let mut t = HostTier::new(1000);
        t.insert(page(1), Bytes::from(vec![0u8; 100]));
        t.insert(page(1), Bytes::from(vec![0u8; 200]));
        assert_eq!((t.len(), t.used_bytes()), (1, 200));
        assert!(t.remove(&page(1)));
        assert!(!t.remove(&page(1)));
        assert_eq!((t.len(), t.used_bytes()), (0, 0));
    }
}
