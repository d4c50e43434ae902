//! How many key splits a decode call uses.

use flash_attn_kernels::config::MAX_DECODE_SPLITS;

/// Fewest keys per split the automatic choice accepts: below this, the partial results and
/// the combine cost more than the parallelism gains.
const MIN_KEYS_PER_SPLIT: usize = 256;

/// The automatic number of key splits for `blocks` (batch × KV heads × query-row tiles)
/// blocks over at most `max_keys` keys on a GPU of `sm_count` SMs: 1 when the blocks already
/// fill the GPU, else enough splits for about two blocks per SM, each split holding at least
/// 256 keys, at most 128 splits.
pub fn decode_splits(sm_count: usize, blocks: usize, max_keys: usize) -> usize {
    let blocks = blocks.max(1);
    if blocks >= sm_count {
        return 1;
    }
    let wanted = (2 * sm_count).div_ceil(blocks);
    let most = (max_keys / MIN_KEYS_PER_SPLIT).max(1);
    wanted.min(most).clamp(1, MAX_DECODE_SPLITS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_gpu_only_when_it_is_not_full() {
        // B = 64, Hkv = 8: 512 blocks on 132 SMs.
        assert_eq!(decode_splits(132, 512, 32 * 1024), 1);
        // B = 1, Hkv = 8, 32K keys: 264 / 8 = 33 splits of ~1K keys.
        assert_eq!(decode_splits(132, 8, 32 * 1024), 33);
        // B = 1, Hkv = 1, 128K keys: capped at 128.
        assert_eq!(decode_splits(132, 1, 128 * 1024), 128);
        // Short caches are not split below 256 keys per split.
        assert_eq!(decode_splits(132, 1, 1000), 3);
        assert_eq!(decode_splits(132, 1, 100), 1);
        assert_eq!(decode_splits(132, 0, 0), 1);
    }
}
