//! Step planning shared by the `glm5_next` backends (CPU and CUDA): each sequence's rows in the
//! flattened batch, and the checks that a step may run on the recurrent-state slots as they
//! stand. Pure policy over the batch and the slots' positions; the backends own the state.

use super::{BackendError, SeqStep};

/// One sequence's rows in a step's flattened batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqRows<'a> {
    /// First row of this sequence in the batch.
    pub row0: usize,
    /// Rows (tokens) this step.
    pub n: usize,
    /// Absolute position of the first row.
    pub start_pos: usize,
    pub table: &'a [u32],
    /// Recurrent-state slot.
    pub slot: usize,
    /// Keep the recurrent state after each token (a draft-verification step), so the step can be
    /// rolled back to any accepted length.
    pub checkpoint: bool,
}

/// The rows of `batch` (already checked by `validate_batch`), refusing token ids outside the
/// vocabulary, slots out of range or shared by two sequences, and a step that does not continue
/// its slot's state (`slot_pos[s]`: the position the slot's state has reached; `None` after a
/// snapshot was written into it). `verify[i]` marks sequence i as a verification step.
pub fn plan_rows<'a>(
    batch: &[SeqStep<'a>],
    verify: &[bool],
    slot_pos: &[Option<usize>],
    vocab: usize,
) -> Result<Vec<SeqRows<'a>>, BackendError> {
    let mut seqs = Vec::with_capacity(batch.len());
    let mut row0 = 0;
    for (i, s) in batch.iter().enumerate() {
        let slot = s.state_slot as usize;
        if slot >= slot_pos.len() {
            return Err(BackendError::InvalidStep(format!(
                "recurrent-state slot {slot} is out of range, the backend has {}",
                slot_pos.len()
            )));
        }
        if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(BackendError::InvalidStep(format!("token id {t} is outside the vocabulary of {vocab}")));
        }
        // The recurrent state can only continue from where it stopped (or from a restored
        // snapshot): anything else means the slot holds another sequence's state.
        if let Some(at) = slot_pos[slot] {
            if s.start_pos != 0 && s.start_pos != at {
                return Err(BackendError::InvalidStep(format!(
                    "recurrent-state slot {slot} holds a state at position {at}, but the step continues from \
                     position {} (restore that position's snapshot with write_state_slot first)",
                    s.start_pos
                )));
            }
        }
        seqs.push(SeqRows {
            row0,
            n: s.tokens.len(),
            start_pos: s.start_pos,
            table: s.block_table,
            slot,
            checkpoint: verify.get(i).copied().unwrap_or(false),
        });
        row0 += s.tokens.len();
    }
    if seqs.iter().enumerate().any(|(i, a)| seqs[..i].iter().any(|b| b.slot == a.slot)) {
        return Err(BackendError::InvalidStep("two sequences in one step share a recurrent-state slot".into()));
    }
    Ok(seqs)
}

/// The batch rows whose logits the step returns (each sequence's last `logits_rows` tokens) and
/// each sequence's first row among them.
pub fn logits_rows(batch: &[SeqStep<'_>], seqs: &[SeqRows<'_>]) -> (Vec<usize>, Vec<usize>) {
    let mut offsets = vec![0];
    let mut rows = Vec::new();
    for (s, sr) in batch.iter().zip(seqs) {
        rows.extend(sr.row0 + sr.n - s.logits_rows..sr.row0 + sr.n);
        offsets.push(rows.len());
    }
    (rows, offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step<'a>(tokens: &'a [u32], start_pos: usize, slot: u32, table: &'a [u32]) -> SeqStep<'a> {
        SeqStep { tokens, start_pos, block_table: table, logits_rows: 1, state_slot: slot }
    }

    #[test]
    fn rows_are_laid_out_in_batch_order_with_their_slots() {
        let t = [0u32];
        let batch = [step(&[1, 2, 3], 0, 1, &t), step(&[4], 7, 0, &t)];
        let seqs = plan_rows(&batch, &[false, true], &[Some(7), Some(0)], 10).unwrap();
        assert_eq!((seqs[0].row0, seqs[0].n, seqs[0].slot, seqs[0].checkpoint), (0, 3, 1, false));
        assert_eq!((seqs[1].row0, seqs[1].n, seqs[1].slot, seqs[1].checkpoint), (3, 1, 0, true));
        assert_eq!(logits_rows(&batch, &seqs), (vec![2, 3], vec![0, 1, 2]));
    }

    #[test]
    fn bad_slots_tokens_and_discontinuous_states_are_refused() {
        let t = [0u32];
        let e = |batch: &[SeqStep<'_>], pos: &[Option<usize>]| plan_rows(batch, &[], pos, 10).unwrap_err().to_string();
        assert!(e(&[step(&[1], 0, 2, &t)], &[Some(0); 2]).contains("out of range"));
        assert!(e(&[step(&[10], 0, 0, &t)], &[Some(0)]).contains("outside the vocabulary"));
        assert!(e(&[step(&[1], 5, 0, &t)], &[Some(4)]).contains("holds a state at position 4"));
        assert!(e(&[step(&[1], 0, 0, &t), step(&[2], 0, 0, &t)], &[Some(0)]).contains("share"));
        // A restored snapshot (no recorded position) may continue from anywhere; position 0 resets.
        assert!(plan_rows(&[step(&[1], 5, 0, &t)], &[], &[None], 10).is_ok());
        assert!(plan_rows(&[step(&[1], 0, 0, &t)], &[], &[Some(9)], 10).is_ok());
    }
}
