//! A device's launch scratch: the data a call's kernels read besides the tensors (the
//! Hopper forward's TMA descriptors and its persistent launches' tile counters, which must
//! start at zero; the ALiBi slopes; a tree mask's words; a block mask's words and tile orders
//! are kept on the device instead, `crate::resident`), assembled on the host
//! ([`LaunchBytes`]) and uploaded by one host-to-device copy per call into a buffer the
//! [`Device`] keeps. A fresh buffer per piece cost an allocation, a free and, for the
//! counters, a memset on the stream besides the copy: driver calls made while the GPU waits
//! for the call's first launch (4–10 µs per forward call on an H200, docs/perf-notes.md,
//! 2026-11-28).
//!
//! Reuse is safe in stream order: every copy and launch of a [`Device`] runs on its one
//! stream, so a call's copy runs after the previous call's kernels have read the buffer.
//! The buffer stays locked from the copy until the call's launches are queued
//! ([`ScratchUpload`]), so that two threads sharing a device cannot interleave their copies
//! and launches.

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::{CudaSlice, DevicePtr};
use std::sync::{Mutex, MutexGuard};

/// Smallest buffer allocated (bytes): one launch's descriptors and counters fit many times.
const MIN_BYTES: usize = 4096;

/// The buffer, grown (never shrunk) to the largest call's bytes.
#[derive(Default)]
pub(crate) struct LaunchScratch {
    buf: Mutex<Option<CudaSlice<u8>>>,
}

/// A call's launch data in the device's scratch buffer, which stays locked while this lives:
/// keep it until the launches that read it are queued.
pub(crate) struct ScratchUpload<'a> {
    _lock: MutexGuard<'a, Option<CudaSlice<u8>>>,
    address: u64,
}

impl ScratchUpload<'_> {
    /// Device address of byte `offset` of the call's launch data ([`LaunchBytes::push`]'s
    /// offsets).
    pub(crate) fn address(&self, offset: usize) -> u64 {
        self.address + offset as u64
    }
}

/// A call's launch data, assembled on the host: each piece at an offset aligned for it.
#[derive(Default)]
pub(crate) struct LaunchBytes {
    bytes: Vec<u8>,
}

impl LaunchBytes {
    /// Appends `data` at the next multiple of `align` (a power of two, at most 256, the
    /// buffer's own alignment) and returns its offset.
    pub(crate) fn push(&mut self, data: &[u8], align: usize) -> usize {
        debug_assert!(align.is_power_of_two() && align <= 256);
        let at = self.bytes.len().next_multiple_of(align);
        self.bytes.resize(at, 0);
        self.bytes.extend_from_slice(data);
        at
    }

    /// Appends `words` (little-endian, 4-byte aligned) and returns their offset.
    pub(crate) fn push_words(&mut self, words: impl IntoIterator<Item = u32>) -> usize {
        let at = self.push(&[], 4);
        self.bytes
            .extend(words.into_iter().flat_map(u32::to_le_bytes));
        at
    }
}

impl LaunchScratch {
    /// Copies `data` to the start of the buffer (in stream order, after the kernels already
    /// queued; nothing when it is empty), growing the buffer first where it is too small. The
    /// start is aligned to 256 bytes (the driver's allocation alignment).
    pub(crate) fn upload<'a>(
        &'a self,
        dev: &Device,
        data: &LaunchBytes,
    ) -> Result<ScratchUpload<'a>> {
        let bytes = &data.bytes;
        let mut lock = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        if bytes.is_empty() {
            return Ok(ScratchUpload {
                _lock: lock,
                address: 0,
            });
        }
        if lock.as_ref().is_none_or(|b| b.len() < bytes.len()) {
            let len = bytes.len().next_power_of_two().max(MIN_BYTES);
            // SAFETY: what a call reads is written by its copy below before any of its
            // launches; the old buffer (dropped here) is freed in stream order, after its
            // readers.
            *lock = Some(unsafe { dev.stream().alloc::<u8>(len)? });
        }
        let buf = lock.as_mut().expect("allocated above");
        dev.stream().memcpy_htod(bytes.as_slice(), buf)?;
        let address = buf.device_ptr(dev.stream()).0;
        Ok(ScratchUpload {
            _lock: lock,
            address,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::LaunchBytes;

    #[test]
    fn pieces_land_at_aligned_offsets_in_order() {
        let mut data = LaunchBytes::default();
        assert_eq!(data.push_words([1, 0x0302_0100]), 0);
        assert_eq!(data.push(&[9; 3], 1), 8);
        // Aligned up past the 11 bytes so far, the gap zeroed.
        assert_eq!(data.push(&[7; 64], 64), 64);
        assert_eq!(data.push_words(std::iter::repeat_n(0, 2)), 128);
        assert_eq!(data.bytes.len(), 136);
        assert_eq!(&data.bytes[..8], &[1, 0, 0, 0, 0, 1, 2, 3]); // little-endian words
        assert!(data.bytes[11..64].iter().all(|&b| b == 0));
        assert!(data.bytes[64..128].iter().all(|&b| b == 7));
    }
}
