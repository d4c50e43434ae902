//! TMA descriptors (`CUtensorMap`) of a Hopper forward launch's Q, K and V, encoded on the
//! host (`cuTensorMapEncodeTiled`, no GPU work) and uploaded with the call's other launch data
//! to global memory ([`crate::scratch`]), where the kernels read them (see
//! `flash_attn_kernels::params::WgmmaFwdParams`).

use cudarc::driver::sys::{
    cuTensorMapEncodeTiled, CUresult, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill,
    CUtensorMapInterleave, CUtensorMapL2promotion, CUtensorMapSwizzle,
};
use flash_attn_kernels::gmma::BLOCK_COLS;
use flash_attn_kernels::params::{FwdParams, TensorRef, TENSOR_MAP_BYTES};

/// Bytes of one launch's three maps (Q, K, V), a multiple of [`TENSOR_MAP_ALIGN`].
pub(crate) const LAUNCH_BYTES: usize = 3 * TENSOR_MAP_BYTES;

/// The alignment of a map in global memory (TMA's: 64 bytes).
pub(crate) const TENSOR_MAP_ALIGN: usize = 64;

/// Encodes the Q, K and V maps of each launch's parameters (Q boxes of `q_rows` rows,
/// [`flash_attn_kernels::params::q_box_rows`] of the kernel; K and V of `block_n`), launch
/// `i`'s at byte `i·LAUNCH_BYTES`. `None` when the driver refuses a layout (then the call
/// takes the `mma.sync` kernel).
pub(crate) fn encode_maps(
    launches: &[FwdParams],
    q_rows: usize,
    block_n: usize,
) -> Option<Vec<u8>> {
    let mut bytes = Vec::with_capacity(launches.len() * LAUNCH_BYTES);
    for p in launches {
        let d = p.dims;
        let q = encode(&p.q, d.head_dim, d.seqlen_q, d.heads_q, d.batch, q_rows)?;
        let k = encode(&p.k, d.head_dim, d.seqlen_k, d.heads_kv, d.batch, block_n)?;
        let v = encode(&p.v, d.head_dim, d.seqlen_k, d.heads_kv, d.batch, block_n)?;
        for map in [q, k, v] {
            bytes.extend(map.opaque.iter().flat_map(|w| w.to_le_bytes()));
        }
    }
    Some(bytes)
}

/// The shape of a map over a `[batch, seq, heads, head_dim]` 16-bit tensor: dims `(head_dim,
/// seq, heads, batch)`, the byte strides of the last three, and boxes of 64 columns × `rows`
/// rows. A dimension of size 1 never steps, but its stride must still be a multiple of 16.
fn geometry(
    t: &TensorRef,
    [head_dim, seq, heads, batch]: [u32; 4],
    rows: usize,
) -> ([u64; 4], [u64; 3], [u32; 4]) {
    // A run without keys launches blocks that load nothing (they write O = 0, LSE = −∞), but
    // the driver refuses an empty dimension: such a map describes one row it never reads.
    let dims = [head_dim, seq.max(1), heads, batch].map(u64::from);
    let stride = |elems: u64, size: u64| if size == 1 { 16 } else { 2 * elems };
    let strides = [
        stride(t.strides.row, dims[1]),
        stride(t.strides.head, dims[2]),
        stride(t.strides.batch, dims[3]),
    ];
    (dims, strides, [BLOCK_COLS as u32, rows as u32, 1, 1])
}

/// The map of a `[batch, seq, heads, head_dim]` 16-bit tensor ([`geometry`]), 128-byte
/// swizzle, zeros outside; `None` where the driver refuses it.
fn encode(
    t: &TensorRef,
    head_dim: u32,
    seq: u32,
    heads: u32,
    batch: u32,
    rows: usize,
) -> Option<CUtensorMap> {
    let (dims, strides, boxes) = geometry(t, [head_dim, seq, heads, batch], rows);
    let element_strides = [1u32; 4];
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array has the rank's length (strides: rank − 1); the encoder only reads
    // them and writes `map`, it touches no device memory.
    let r = unsafe {
        cuTensorMapEncodeTiled(
            &mut map,
            CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT16,
            4,
            t.ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    (r == CUresult::CUDA_SUCCESS).then_some(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flash_attn_kernels::params::Strides;

    #[test]
    fn maps_follow_the_tensor_strides_in_bytes() {
        // [B = 2, N = 300, H = 4, d = 128] contiguous: row 512, head 128, batch 153600 elements.
        let t = TensorRef {
            ptr: 0x1000,
            strides: Strides {
                batch: 300 * 512,
                row: 512,
                head: 128,
            },
        };
        let (dims, strides, boxes) = geometry(&t, [128, 300, 4, 2], 128);
        assert_eq!(dims, [128, 300, 4, 2]);
        assert_eq!(strides, [1024, 256, 307_200]);
        assert_eq!(boxes, [64, 128, 1, 1]);
        // One head and one batch entry: their strides never step and stay valid.
        let (_, strides, _) = geometry(&t, [104, 300, 1, 1], 128);
        assert_eq!(strides, [1024, 16, 16]);
        let (dims, _, _) = geometry(&t, [128, 0, 4, 2], 128);
        assert_eq!(dims, [128, 1, 4, 2]);
    }
}
