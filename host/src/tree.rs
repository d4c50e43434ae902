//! Tree masks for speculative decoding ([`TreeMask`]): which draft tokens each draft token
//! sees, given directly or built from a parent array.

use crate::error::{FlashError, Result};

/// A tree of `T` draft tokens per batch entry (or one tree for every entry): draft `i` (query
/// `i`, and key `Nk − T + i`) sees draft `t` when bit (b, i, t) is set; the keys before the
/// drafts (the cached prefix) stay fully visible. Stored as `[B or 1, T]` rows of `⌈T/32⌉`
/// u32 words, bit `t % 32` of word `t / 32`. Pass it to [`crate::AttnParams::tree_mask`] as
/// [`TreeMask::as_ref`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeMask {
    batch: usize,
    drafts: usize,
    words: Vec<u32>,
}

/// A borrowed [`TreeMask`] (what [`crate::AttnParams`] holds; `Copy`, and one batch entry's
/// part is a sub-slice: [`TreeMaskRef::entry`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeMaskRef<'a> {
    batch: usize,
    drafts: usize,
    words: &'a [u32],
}

/// Words per row of a tree over `drafts` tokens.
fn row_words(drafts: usize) -> usize {
    drafts.div_ceil(32)
}

impl TreeMask {
    /// The tree of `batch` entries (1: shared) of `drafts` tokens with bit `sees(b, i, t)`.
    /// Errors: [`FlashError::Shape`] for a zero size, [`FlashError::TooLarge`] past `u32`
    /// words.
    pub fn from_fn(
        batch: usize,
        drafts: usize,
        mut sees: impl FnMut(usize, usize, usize) -> bool,
    ) -> Result<Self> {
        if batch == 0 || drafts == 0 {
            return Err(FlashError::Shape(format!(
                "tree mask [{batch}, {drafts}, {drafts}]: batch and drafts must be ≥ 1"
            )));
        }
        let words_per_row = row_words(drafts);
        let n = batch
            .checked_mul(drafts)
            .and_then(|x| x.checked_mul(words_per_row))
            .filter(|&n| n <= u32::MAX as usize)
            .ok_or_else(|| FlashError::TooLarge(format!("tree mask of {drafts} drafts")))?;
        let mut words = vec![0u32; n];
        for b in 0..batch {
            for i in 0..drafts {
                let row = (b * drafts + i) * words_per_row;
                for t in 0..drafts {
                    if sees(b, i, t) {
                        words[row + t / 32] |= 1 << (t % 32);
                    }
                }
            }
        }
        Ok(Self {
            batch,
            drafts,
            words,
        })
    }

    /// The tree of a dense `[B or 1, T, T]` array (row-major), nonzero where draft `i` sees
    /// draft `t` (the CLI's `tree_mask`).
    pub fn from_dense(batch: usize, drafts: usize, dense: &[i32]) -> Result<Self> {
        if dense.len() != batch * drafts * drafts {
            return Err(FlashError::Shape(format!(
                "tree mask [{batch}, {drafts}, {drafts}] needs {} values, got {}",
                batch * drafts * drafts,
                dense.len()
            )));
        }
        Self::from_fn(batch, drafts, |b, i, t| {
            dense[(b * drafts + i) * drafts + t] != 0
        })
    }

    /// The tree of parent arrays `[B or 1, T]` (row-major): `parents[i]` is the draft that
    /// draft `i` continues (`0 ≤ parent < i`), or −1 for a draft that continues the prefix.
    /// Draft `i` sees itself and its ancestors. Errors: [`FlashError::Shape`] for a parent
    /// that is not an earlier draft or −1.
    pub fn from_parents(batch: usize, drafts: usize, parents: &[i32]) -> Result<Self> {
        if parents.len() != batch * drafts {
            return Err(FlashError::Shape(format!(
                "tree parents [{batch}, {drafts}] needs {} values, got {}",
                batch * drafts,
                parents.len()
            )));
        }
        for (at, &p) in parents.iter().enumerate() {
            let i = at % drafts;
            if p < -1 || p >= i as i32 {
                return Err(FlashError::Shape(format!(
                    "tree parents[{}, {i}] = {p}: a parent must be an earlier draft (0..{i}) or -1",
                    at / drafts
                )));
            }
        }
        Self::from_fn(batch, drafts, |b, i, t| {
            let mut node = i as i32;
            while node > t as i32 {
                node = parents[b * drafts + node as usize];
            }
            node == t as i32
        })
    }

    /// The borrowed form [`crate::AttnParams`] takes.
    pub fn as_ref(&self) -> TreeMaskRef<'_> {
        TreeMaskRef {
            batch: self.batch,
            drafts: self.drafts,
            words: &self.words,
        }
    }
}

impl<'a> TreeMaskRef<'a> {
    /// `[B or 1, T, T]`.
    pub fn dims(&self) -> [usize; 3] {
        [self.batch, self.drafts, self.drafts]
    }

    /// Whether draft `i` of entry `b` sees draft `t` (a shared tree serves every entry).
    pub fn get(&self, b: usize, i: usize, t: usize) -> bool {
        let row = ((b % self.batch) * self.drafts + i) * row_words(self.drafts);
        self.words[row + t / 32] >> (t % 32) & 1 != 0
    }

    /// Entry `b`'s tree alone (a shared tree as it is).
    pub fn entry(&self, b: usize) -> TreeMaskRef<'a> {
        if self.batch == 1 {
            return *self;
        }
        let n = self.drafts * row_words(self.drafts);
        TreeMaskRef {
            batch: 1,
            drafts: self.drafts,
            words: &self.words[b * n..(b + 1) * n],
        }
    }

    /// The packed words (what the kernels read).
    pub(crate) fn words(&self) -> &'a [u32] {
        self.words
    }

    /// Words between two entries' rows (0 when shared).
    pub(crate) fn batch_stride(&self) -> usize {
        if self.batch == 1 {
            0
        } else {
            self.drafts * row_words(self.drafts)
        }
    }

    /// Checks the tree against a call of `batch` entries whose `seqlen_q` queries are the
    /// drafts and whose longest key count is `seqlen_k`. Errors: [`FlashError::Shape`].
    pub fn check(&self, batch: usize, seqlen_q: usize, seqlen_k: usize) -> Result<()> {
        if (self.batch != 1 && self.batch != batch) || self.drafts != seqlen_q {
            return Err(FlashError::Shape(format!(
                "tree mask is {:?}, expected [{batch} or 1, {seqlen_q}, {seqlen_q}] (the queries are the draft tokens)",
                self.dims()
            )));
        }
        if seqlen_k < seqlen_q {
            return Err(FlashError::Shape(format!(
                "a tree mask needs the {seqlen_q} drafts among the keys, but there are {seqlen_k} keys"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parents_give_ancestor_sets() {
        // 0 ← 1 ← 3, 0 ← 2, and 4 continues the prefix.
        let t = TreeMask::from_parents(1, 5, &[-1, 0, 0, 1, -1]).unwrap();
        let t = t.as_ref();
        let sees = |i: usize| (0..5).filter(|&j| t.get(0, i, j)).collect::<Vec<_>>();
        assert_eq!(sees(0), [0]);
        assert_eq!(sees(3), [0, 1, 3]);
        assert_eq!(sees(2), [0, 2]);
        assert_eq!(sees(4), [4]);
        assert!(TreeMask::from_parents(1, 3, &[-1, 1, 0]).is_err());
        assert!(TreeMask::from_parents(1, 3, &[-1, 0, -2]).is_err());
        assert!(t.check(4, 5, 9).is_ok() && t.check(4, 5, 4).is_err() && t.check(4, 6, 9).is_err());
        let two = TreeMask::from_fn(2, 40, |b, i, t| (b + i + t) % 2 == 0).unwrap();
        let e = two.as_ref().entry(1);
        assert!(e.get(0, 0, 1) && !e.get(0, 0, 0) && e.get(7, 3, 38) && !e.get(7, 3, 39));
        assert_eq!(two.as_ref().batch_stride(), 80);
    }
}
