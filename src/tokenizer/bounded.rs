//! Refusing a prompt that cannot fit the context without tokenizing all of it: the text is
//! encoded in bounded pieces, and counting stops as soon as the pieces prove the prompt longer
//! than the limit. A 30 MB prompt against an 8k context costs one or two 64 KiB pieces, not the
//! whole text.

use super::{TokenizerBundle, TokenizerError};

/// Bytes encoded at a time. Texts up to this size are simply encoded whole by the caller.
pub const PIECE_BYTES: usize = 64 << 10;

/// `Some(n)` when `text` surely encodes to `n >= limit` tokens or more (so a prompt of it leaves
/// no room in a `limit`-token context); `None` when it may fit, and the caller encodes it.
///
/// Pieces are cut just before a whitespace character that follows a non-whitespace one, where
/// byte-level and metaspace pre-tokenizers split anyway; one token per cut is still subtracted
/// from the count, for a merge a cut might break, so the bound never overstates the prompt.
pub fn proves_over(bundle: &TokenizerBundle, text: &str, limit: usize) -> Result<Option<usize>, TokenizerError> {
    if text.len() <= PIECE_BYTES {
        return Ok(None);
    }
    let mut counted = 0usize;
    let mut cuts = 0usize;
    let mut rest = text;
    while !rest.is_empty() {
        let end = piece_end(rest, PIECE_BYTES);
        counted += bundle.encode(&rest[..end], false)?.len();
        rest = &rest[end..];
        if !rest.is_empty() {
            cuts += 1;
        }
        let at_least = counted.saturating_sub(cuts);
        if at_least >= limit {
            return Ok(Some(at_least));
        }
    }
    Ok(None)
}

/// The end of the next piece: the last "non-space then space" boundary at or before `max`
/// bytes, else the last char boundary (text without spaces), else the whole rest.
fn piece_end(s: &str, max: usize) -> usize {
    if s.len() <= max {
        return s.len();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    let head = &s[..end];
    let mut prev_space = true;
    let mut best = None;
    for (i, c) in head.char_indices() {
        let space = c.is_whitespace();
        if space && !prev_space && i > 0 {
            best = Some(i);
        }
        prev_space = space;
    }
    best.unwrap_or(if end > 0 { end } else { s.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_end_before_a_space_that_follows_a_word() {
        assert_eq!(piece_end("abc def ghi", 100), 11);
        assert_eq!(piece_end("abc def ghi", 9), 7);
        assert_eq!(piece_end("abc   def", 8), 3);
        assert_eq!(piece_end("abcdefgh", 5), 5, "no space: cut at the limit");
        let s = "ééééé";
        assert!(s.is_char_boundary(piece_end(s, 5)));
        assert!(piece_end(s, 1) > 0, "always progresses");
    }
}
