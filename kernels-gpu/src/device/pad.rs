//! Layout kernel: copies a strided `[batch, seq, head, dim]` tensor of 16-bit elements to or
//! from a contiguous tensor whose rows are zero-padded to `packed_dim`. The host uses it when
//! the caller's tensors do not meet the forward kernel's alignment rule (row starts on 16
//! bytes, head dim a multiple of 8); it moves each element once, one thread per element of the
//! packed tensor, grid-stride. No shared memory, no barriers.

use super::ptx;
use crate::params::{PadParams, PAD_SCATTER};

/// The body of `pad_copy_b16`.
///
/// # Safety
/// Both tensors are readable/writable over the extents `p` describes.
#[inline(always)]
pub unsafe fn pad_copy_b16(p: &PadParams) {
    let total = p.batch as u64 * p.seqlen as u64 * p.heads as u64 * p.packed_dim as u64;
    let step = ptx::nctaid_x() as u64 * ptx::ntid_x() as u64;
    let (bx, _, _) = ptx::ctaid();
    let mut idx = bx as u64 * ptx::ntid_x() as u64 + ptx::tid_x() as u64;
    let scatter = p.flags & PAD_SCATTER != 0;
    while idx < total {
        let col = (idx % p.packed_dim as u64) as u32;
        let rest = idx / p.packed_dim as u64;
        let head = (rest % p.heads as u64) as u32;
        let rest = rest / p.heads as u64;
        let row = (rest % p.seqlen as u64) as u32;
        let batch = (rest / p.seqlen as u64) as u32;
        let packed = (p.packed as *mut u16).add(idx as usize);
        let strided = (p.strided.ptr as *mut u16)
            .add((p.strided.strides.offset(batch, row, head) + col as u64) as usize);
        if scatter {
            if col < p.dim {
                *strided = *packed;
            }
        } else {
            *packed = if col < p.dim { *strided } else { 0 };
        }
        idx += step;
    }
}
