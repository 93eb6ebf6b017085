//! Driving the ranks of a tensor-parallel group held in one process: one step on every rank at
//! once (rank 0 on the calling thread, the others on scoped threads), rank 0's result returned,
//! any rank's failure or panic turned into the step's error; and the KV image of a group (each
//! block is every rank's image of that block, in rank order). Used by the CPU and CUDA TP
//! backends; adds no numerics and makes no policy decisions.

use super::{Backend, BackendError};

/// Run `lead` on rank 0 and `follow` on every other rank, all at once; rank 0's result, or the
/// first failure (rank 0's own error first: the others' are usually the abort it caused).
pub fn lockstep<R: Send, T>(
    ranks: &mut [R],
    lead: impl FnOnce(&mut R) -> Result<T, BackendError>,
    follow: impl Fn(&mut R) -> Result<(), BackendError> + Sync,
) -> Result<T, BackendError> {
    let Some((first, rest)) = ranks.split_first_mut() else {
        return Err(BackendError::InvalidStep("a tensor-parallel group without ranks".into()));
    };
    let follow = &follow;
    let (lead, others) = std::thread::scope(|s| {
        let handles: Vec<_> = rest.iter_mut().map(|r| s.spawn(move || follow(r))).collect();
        let lead = lead(first);
        let others: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        (lead, others)
    });
    let lead = lead?;
    for (i, r) in others.into_iter().enumerate() {
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(BackendError::Device(format!("tensor parallel rank {} panicked", i + 1))),
        }
    }
    Ok(lead)
}

/// Bytes of one block of the group's KV image.
pub fn group_block_bytes<B: Backend>(ranks: &[B]) -> usize {
    ranks.iter().map(Backend::kv_block_bytes).sum()
}

/// The group's KV image of `blocks`: block after block, each block the ranks' parts in order (so
/// the spill tier may cut the image at block boundaries).
pub fn read_group_kv<B: Backend>(ranks: &mut [B], blocks: &[u32]) -> Result<Vec<u8>, BackendError> {
    // One rank's image is the group's: no interleaving copy (as in `write_group_kv`).
    if let [only] = ranks {
        return only.read_kv_blocks(blocks);
    }
    let parts = ranks.iter_mut().map(|r| r.read_kv_blocks(blocks)).collect::<Result<Vec<_>, _>>()?;
    let widths: Vec<usize> = ranks.iter().map(Backend::kv_block_bytes).collect();
    let mut image = Vec::with_capacity(blocks.len() * widths.iter().sum::<usize>());
    for b in 0..blocks.len() {
        for (part, &w) in parts.iter().zip(&widths) {
            image.extend_from_slice(&part[b * w..(b + 1) * w]);
        }
    }
    Ok(image)
}

/// Write an image from [`read_group_kv`] back into `blocks` of every rank.
pub fn write_group_kv<B: Backend>(ranks: &mut [B], blocks: &[u32], image: &[u8]) -> Result<(), BackendError> {
    // One rank holds the whole image: no split, no copy (copying a 32 MiB page into fresh memory
    // took ~25 ms, most of a restored page's cost).
    if let [only] = ranks {
        return only.write_kv_blocks(blocks, image);
    }
    let widths: Vec<usize> = ranks.iter().map(Backend::kv_block_bytes).collect();
    let block_bytes: usize = widths.iter().sum();
    if block_bytes == 0 || image.len() != blocks.len() * block_bytes {
        return Err(BackendError::InvalidStep(format!(
            "a KV image of {} bytes for {} blocks of {block_bytes} bytes",
            image.len(),
            blocks.len()
        )));
    }
    let mut parts: Vec<Vec<u8>> = widths.iter().map(|w| Vec::with_capacity(w * blocks.len())).collect();
    for block in image.chunks_exact(block_bytes) {
        let mut at = 0;
        for (part, &w) in parts.iter_mut().zip(&widths) {
            part.extend_from_slice(&block[at..at + w]);
            at += w;
        }
    }
    for (rank, part) in ranks.iter_mut().zip(parts) {
        rank.write_kv_blocks(blocks, &part)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lockstep_returns_the_lead_or_the_first_failure() {
        let mut ranks = vec![0u32; 3];
        let out = lockstep(
            &mut ranks,
            |r| Ok(*r + 7),
            |r| {
                *r += 1;
                Ok(())
            },
        );
        assert_eq!(out.unwrap(), 7);
        assert_eq!(ranks, [0, 1, 1]);
        let e = lockstep(
            &mut ranks,
            |_| Ok(()),
            |r| if *r == 1 { Err(BackendError::Device("boom".into())) } else { Ok(()) },
        );
        assert!(e.unwrap_err().to_string().contains("boom"));
        let lead_first: Result<(), _> = lockstep(
            &mut ranks,
            |_| Err(BackendError::Device("lead".into())),
            |_| Err(BackendError::Device("other".into())),
        );
        assert!(lead_first.unwrap_err().to_string().contains("lead"));
        let panicked = lockstep(&mut ranks, |_| Ok(()), |_| panic!("rank died"));
        assert!(panicked.unwrap_err().to_string().contains("panicked"));
        let empty: Result<(), _> = lockstep(&mut Vec::<u32>::new(), |_| Ok(()), |_| Ok(()));
        assert!(empty.is_err());
    }
}
