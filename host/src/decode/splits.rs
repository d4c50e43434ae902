//! How many key splits a decode call uses.

/// Fewest keys per split the automatic choice accepts (one 16-key step for each warp of an
/// 8-warp block): below this, the partial results and the combine cost more than the
/// parallelism gains. Measured on the H100, B = 1, Hkv = 1, 8K keys, with the combine's loads
/// in flight together: 16 / 32 / 48 / 64 splits took 25.9 / 24.2 / 21.8 / 23.3 µs
/// (docs/perf-notes.md, decode v6; 512 keys, the floor before, gave 16).
const MIN_KEYS_PER_SPLIT: usize = 128;

/// Most splits the automatic choice takes (callers may ask for up to
/// [`flash_attn_kernels::config::MAX_DECODE_SPLITS`]). Measured on the H100, B = 1, Hkv = 1:
/// at 128K keys 64 splits took 57 µs against 73 µs for 128; at 32K, 32–64 splits 35–37 µs
/// against 51 µs for 128 (docs/perf-notes.md, decode v4).
const AUTO_MAX_SPLITS: usize = 64;

/// Most keys per block for which blocks that nearly fill half the GPU stay unsplit
/// ([`decode_splits`]): there the second split's gain is smaller than the combine's launch.
/// Measured on the H100 (2026-11-27, docs/perf-notes.md), 128 blocks of 264 slots (B = 64,
/// Hkv = 1 and B = 8, Hkv = 8; Hq = 32, d = 128), 1 split against 2: 0.83× the time at 1K
/// keys and 0.93× at 8K (Hkv = 1), 0.93× and 0.97× (Hkv = 8); 1.03–1.04× at 32K and
/// 1.10–1.15× at 128K.
const UNSPLIT_MAX_KEYS: usize = 8 * 1024;

/// The automatic number of key splits for `blocks` (batch × KV heads × query-row tiles)
/// blocks over at most `max_keys` keys on a GPU that holds `resident` decode blocks at once
/// (SMs × blocks per SM): 1 when the blocks already fill half of it, or nearly (15/16 of
/// half) over at most 8K keys; else as many splits as fit in one wave
/// (rounded down: a second, mostly idle wave costs more than a few idle slots), each split
/// holding at least 128 keys, at most 64 splits.
pub fn decode_splits(resident: usize, blocks: usize, max_keys: usize) -> usize {
    let nearly_half = 32 * blocks.max(1) >= 15 * resident;
    if nearly_half && max_keys <= UNSPLIT_MAX_KEYS {
        return 1;
    }
    filling_splits(resident, blocks, max_keys)
}

/// [`decode_splits`] without its exception for short caches: 1 when the blocks already fill
/// half the GPU, else as many splits as fill one wave (at least 128 keys each, at most 64).
/// `flash_attn` takes the split-KV path where this is above 1 (its own blocks would leave the
/// GPU half idle).
pub fn filling_splits(resident: usize, blocks: usize, max_keys: usize) -> usize {
    let blocks = blocks.max(1);
    if 2 * blocks >= resident {
        return 1;
    }
    let wanted = resident / blocks;
    let most = (max_keys / MIN_KEYS_PER_SPLIT).max(1);
    wanted.min(most).clamp(1, AUTO_MAX_SPLITS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_fill_the_gpu_only_when_it_is_not_full() {
        // 132 SMs, two blocks each. B = 64, Hkv = 8: 512 blocks.
        assert_eq!(decode_splits(264, 512, 32 * 1024), 1);
        // B = 1, Hkv = 8, 32K keys: 264 / 8 = 33 splits of ~1K keys.
        assert_eq!(decode_splits(264, 8, 32 * 1024), 33);
        // B = 1, Hkv = 1, 8K keys: capped at 64 splits of 128 keys.
        assert_eq!(decode_splits(132, 1, 8 * 1024), 64);
        assert_eq!(decode_splits(132, 1, 4 * 1024), 32);
        // One block per SM: 132 / 8 = 16 (rounded down: 17 would need a second wave).
        assert_eq!(decode_splits(132, 8, 32 * 1024), 16);
        assert_eq!(decode_splits(132, 64, 32 * 1024), 2);
        assert_eq!(decode_splits(132, 66, 32 * 1024), 1);
        // B = 1, Hkv = 1, 128K keys: capped at 64.
        assert_eq!(decode_splits(264, 1, 128 * 1024), 64);
        // Short caches are not split below 128 keys per split.
        assert_eq!(decode_splits(264, 1, 1000), 7);
        assert_eq!(decode_splits(264, 1, 1024), 8);
        assert_eq!(decode_splits(264, 1, 255), 1);
        assert_eq!(decode_splits(264, 1, 256), 2);
        assert_eq!(decode_splits(264, 1, 100), 1);
        assert_eq!(decode_splits(264, 0, 0), 1);
        // Blocks filling half the GPU are not split.
        assert_eq!(decode_splits(264, 132, 1 << 20), 1);
        assert_eq!(decode_splits(264, 131, 1 << 20), 2);
        // Nearly half (B = 64, Hkv = 1 or B = 8, Hkv = 8 on 132 SMs: 128 blocks): not split
        // up to 8K keys, split in two above.
        assert_eq!(decode_splits(264, 128, 1024), 1);
        assert_eq!(decode_splits(264, 128, 8 * 1024), 1);
        assert_eq!(decode_splits(264, 128, 8 * 1024 + 1), 2);
        assert_eq!(decode_splits(264, 128, 32 * 1024), 2);
        assert_eq!(decode_splits(264, 124, 8 * 1024), 1);
        assert_eq!(decode_splits(264, 123, 8 * 1024), 2);
    }
}
