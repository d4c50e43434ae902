//! The KV-cache append: copies this call's new keys and values into the cache, after each
//! sequence's cached ones (through the block table when paged). One thread per element,
//! grid-stride; any head dim and any alignment.

use super::super::ptx;
use crate::params::AppendParams;

/// `cache[b, seqlens[b] + i, h, c] = new[b, i, h, c]` for K and V.
///
/// # Safety
/// Launched by the host on parameters it validated: every target key lies inside the cache
/// (and inside a page the block table names).
#[inline(always)]
pub unsafe fn kv_append(p: &AppendParams) {
    let (bx, _, _) = ptx::ctaid();
    let threads = ptx::ntid_x() as u64;
    let step = ptx::nctaid_x() as u64 * threads;
    let (d, heads, n) = (p.head_dim as u64, p.heads_kv as u64, p.kv.appended as u64);
    let total = p.batch as u64 * n * heads * d;
    let mut idx = bx as u64 * threads + ptx::tid_x() as u64;
    while idx < total {
        let c = (idx % d) as u32;
        let head = ((idx / d) % heads) as u32;
        let i = ((idx / (d * heads)) % n) as u32;
        let batch = (idx / (d * heads * n)) as u32;
        let key = p.kv.cached(batch).saturating_add(i);
        idx += step;
        if key >= p.kv.capacity {
            continue; // only with lengths the host did not see (see `KvLayout`)
        }
        let (entry, row) = p.kv.key_slot(batch, key);
        for (new, cache) in [(&p.k_new, &p.k), (&p.v_new, &p.v)] {
            let src = (new.ptr as *const u16)
                .add((new.strides.offset(batch, i, head) + c as u64) as usize);
            let dst = (cache.ptr as *mut u16)
                .add((cache.strides.offset(entry, row, head) + c as u64) as usize);
            *dst = *src;
        }
    }
}
