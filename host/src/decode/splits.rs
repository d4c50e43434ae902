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
/// ([`decode_splits`]) on a GPU whose memory gives each SM at most
/// [`ONE_BLOCK_FILLS_GBPS_PER_SM`]: there the second split's gain is smaller than the
/// combine's launch. Measured on the H100 (2026-11-27, docs/perf-notes.md), 128 blocks of 264
/// slots (B = 64, Hkv = 1 and B = 8, Hkv = 8; Hq = 32, d = 128), 1 split against 2: 0.83× the
/// time at 1K keys and 0.93× at 8K (Hkv = 1), 0.93× and 0.97× (Hkv = 8); 1.03–1.04× at 32K and
/// 1.10–1.15× at 128K.
const UNSPLIT_MAX_KEYS: usize = 8 * 1024;

/// [`UNSPLIT_MAX_KEYS`] on GPUs whose memory gives each SM more than
/// [`ONE_BLOCK_FILLS_GBPS_PER_SM`] (the H200), or of unknown bandwidth. Measured on the H200
/// (2026-11-27, docs/perf-notes.md), the same shapes, 1 split against 2 (best of three rounds,
/// every layout): B = 64 / Hkv = 1 0.81–0.84× the time at 1K keys, 0.86–0.90× at 2K,
/// 0.94–1.00× at 4K, 1.10–1.16× at 8K; B = 8 / Hkv = 8 0.86–0.95×, 0.96–1.01×, 1.10–1.15×,
/// 1.17–1.26×.
const UNSPLIT_MAX_KEYS_FAST_MEMORY: usize = 2 * 1024;

/// Peak memory bandwidth per SM (GB/s) up to which one decode block per SM nearly fills the
/// memory. One wave of single blocks (B = 8 / 8K / Hkv = 8, 128 blocks, 1 split) streamed
/// 2.76 TB/s on the H100 and 2.89 TB/s on the H200: 82 % of the H100's 3.35 TB/s (25.4 GB/s
/// per SM), 60 % of the H200's 4.8 (36.5 GB/s per SM), where two splits reached 3.47 TB/s.
const ONE_BLOCK_FILLS_GBPS_PER_SM: f64 = 28.0;

/// The automatic number of key splits for `blocks` (batch × KV heads × query-row tiles)
/// blocks over at most `max_keys` keys on a GPU that holds `resident` decode blocks at once
/// (SMs × blocks per SM) and whose memory gives each SM `gbps_per_sm` GB/s at its peak (0 when
/// unknown): 1 when the blocks already fill half of it, or nearly (15/16 of half) over at most
/// 8K keys where `gbps_per_sm` is at most 28 (one block per SM then nearly fills the memory:
/// the H100; else at most 2K keys); else as many splits as fit in one wave (rounded down: a
/// second, mostly idle wave costs more than a few idle slots), each split holding at least 128
/// keys, at most 64 splits.
pub fn decode_splits(resident: usize, blocks: usize, max_keys: usize, gbps_per_sm: f64) -> usize {
    let nearly_half = 32 * blocks.max(1) >= 15 * resident;
    let one_block_fills = gbps_per_sm > 0.0 && gbps_per_sm <= ONE_BLOCK_FILLS_GBPS_PER_SM;
    let unsplit_max_keys = if one_block_fills {
        UNSPLIT_MAX_KEYS
    } else {
        UNSPLIT_MAX_KEYS_FAST_MEMORY
    };
    if nearly_half && max_keys <= unsplit_max_keys {
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

    /// Peak memory bandwidth per SM of the H100 SXM (3.35 TB/s over 132 SMs) and of the H200
    /// (4.8 TB/s).
    const H100: f64 = 25.4;
    const H200: f64 = 36.4;

    #[test]
    fn splits_fill_the_gpu_only_when_it_is_not_full() {
        // 132 SMs, two blocks each. B = 64, Hkv = 8: 512 blocks.
        assert_eq!(decode_splits(264, 512, 32 * 1024, H100), 1);
        // B = 1, Hkv = 8, 32K keys: 264 / 8 = 33 splits of ~1K keys.
        assert_eq!(decode_splits(264, 8, 32 * 1024, H100), 33);
        // B = 1, Hkv = 1, 8K keys: capped at 64 splits of 128 keys.
        assert_eq!(decode_splits(132, 1, 8 * 1024, H100), 64);
        assert_eq!(decode_splits(132, 1, 4 * 1024, H100), 32);
        // One block per SM: 132 / 8 = 16 (rounded down: 17 would need a second wave).
        assert_eq!(decode_splits(132, 8, 32 * 1024, H100), 16);
        assert_eq!(decode_splits(132, 64, 32 * 1024, H100), 2);
        assert_eq!(decode_splits(132, 66, 32 * 1024, H100), 1);
        // B = 1, Hkv = 1, 128K keys: capped at 64.
        assert_eq!(decode_splits(264, 1, 128 * 1024, H100), 64);
        // Short caches are not split below 128 keys per split.
        assert_eq!(decode_splits(264, 1, 1000, H100), 7);
        assert_eq!(decode_splits(264, 1, 1024, H100), 8);
        assert_eq!(decode_splits(264, 1, 255, H100), 1);
        assert_eq!(decode_splits(264, 1, 256, H100), 2);
        assert_eq!(decode_splits(264, 1, 100, H100), 1);
        assert_eq!(decode_splits(264, 0, 0, H100), 1);
        // Blocks filling half the GPU are not split.
        assert_eq!(decode_splits(264, 132, 1 << 20, H100), 1);
        assert_eq!(decode_splits(264, 131, 1 << 20, H100), 2);
        // Nearly half (B = 64, Hkv = 1 or B = 8, Hkv = 8 on 132 SMs: 128 blocks): not split
        // up to 8K keys, split in two above.
        assert_eq!(decode_splits(264, 128, 1024, H100), 1);
        assert_eq!(decode_splits(264, 128, 8 * 1024, H100), 1);
        assert_eq!(decode_splits(264, 128, 8 * 1024 + 1, H100), 2);
        assert_eq!(decode_splits(264, 128, 32 * 1024, H100), 2);
        assert_eq!(decode_splits(264, 124, 8 * 1024, H100), 1);
        assert_eq!(decode_splits(264, 123, 8 * 1024, H100), 2);
    }

    #[test]
    fn faster_memory_or_an_unknown_one_splits_nearly_half_above_2k_keys() {
        for gbps in [H200, 0.0, ONE_BLOCK_FILLS_GBPS_PER_SM + 0.1] {
            assert_eq!(decode_splits(264, 128, 1024, gbps), 1);
            assert_eq!(decode_splits(264, 128, 2048, gbps), 1);
            assert_eq!(decode_splits(264, 128, 2049, gbps), 2);
            assert_eq!(decode_splits(264, 128, 4096, gbps), 2);
            assert_eq!(decode_splits(264, 128, 8 * 1024, gbps), 2);
            // The rest of the rule does not depend on the memory.
            assert_eq!(decode_splits(264, 132, 1 << 20, gbps), 1);
            assert_eq!(decode_splits(264, 8, 32 * 1024, gbps), 33);
            assert_eq!(decode_splits(132, 1, 4 * 1024, gbps), 32);
        }
        assert_eq!(
            decode_splits(264, 128, 8 * 1024, ONE_BLOCK_FILLS_GBPS_PER_SM),
            1
        );
    }
}
