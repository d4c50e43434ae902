//! A device's launch scratch: the data a call's kernels read besides the tensors (the
//! Hopper forward's TMA descriptors, the ALiBi slopes, a tree mask's words; a block mask's
//! words and tile orders are kept on the device instead, `crate::resident`), assembled on the
//! host ([`LaunchBytes`]) and uploaded by one host-to-device copy into a buffer the [`Device`]
//! keeps, and the persistent forward launches' tile counter. A fresh buffer per piece cost an
//! allocation, a free and, for the counters, a memset on the stream besides the copy: driver
//! calls made while the GPU waits for the call's first launch (4–10 µs per forward call on an
//! H200, docs/perf-notes.md, 2026-11-28).
//!
//! The copy is made only when the call's data differ from what the buffer holds (or while the
//! stream is being captured into a CUDA graph, which must record it): a call that repeats the
//! previous call's data (the same tensors, hence the same descriptors, and the same mask)
//! launches at once, with no copy in front of its kernels (docs/perf-notes.md, 2026-11-30).
//! The tile counter is one u32, zeroed when the device is created; every persistent launch
//! takes its tiles from it by `atom.inc` bounded by its tile count, which leaves it at zero
//! again for the next launch (`WgmmaFwdParams::tile_counter`).
//!
//! Reuse is safe in stream order: every copy and launch of a [`Device`] runs on its one
//! stream, so a call's copy runs after the previous calls' kernels have read the buffer, a
//! call that skips the copy reads what the last copy wrote, which no later copy has
//! overwritten, and launches take the counter one after the other. The buffer stays locked
//! from the copy (or its skip) until the call's launches are queued ([`ScratchUpload`]), so
//! that two threads sharing a device cannot interleave their copies and launches.

use crate::device::Device;
use crate::error::Result;
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::{Arc, Mutex, MutexGuard};

/// Smallest buffer allocated (bytes): one launch's descriptors fit many times.
const MIN_BYTES: usize = 4096;

/// The buffer, grown (never shrunk) to the largest call's bytes, a record of its contents,
/// and the tile counter.
pub(crate) struct LaunchScratch {
    state: Mutex<ScratchState>,
    /// The persistent launches' tile counter (zero between launches).
    counter: CudaSlice<u32>,
}

/// The scratch buffer and the data of its last copy.
#[derive(Default)]
struct ScratchState {
    buf: Option<CudaSlice<u8>>,
    /// The data of the last copy (`None`: the buffer's contents are unknown).
    held: Option<Vec<u8>>,
}

/// A call's launch data in the device's scratch buffer, which stays locked while this lives:
/// keep it until the launches that read it are queued.
pub(crate) struct ScratchUpload<'a> {
    _lock: MutexGuard<'a, ScratchState>,
    address: u64,
    counter: u64,
}

impl ScratchUpload<'_> {
    /// Device address of byte `offset` of the call's launch data ([`LaunchBytes::push`]'s
    /// offsets).
    pub(crate) fn address(&self, offset: usize) -> u64 {
        self.address + offset as u64
    }

    /// Device address of the persistent launches' tile counter, a u32 that is zero when a
    /// launch starts and that each launch leaves at zero.
    pub(crate) fn tile_counter(&self) -> u64 {
        self.counter
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
    /// An empty buffer and a zeroed tile counter on `stream`.
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(Self {
            state: Mutex::default(),
            counter: stream.alloc_zeros::<u32>(1)?,
        })
    }

    /// Makes `data` the buffer's contents: a copy in stream order, after the kernels already
    /// queued, unless the buffer holds the same data already and the stream is not being
    /// captured (nothing for empty data), growing the buffer first where it is too small.
    /// The start is aligned to 256 bytes (the driver's allocation alignment).
    pub(crate) fn upload<'a>(
        &'a self,
        dev: &Device,
        data: &LaunchBytes,
    ) -> Result<ScratchUpload<'a>> {
        let bytes = &data.bytes;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let counter = self.counter.device_ptr(dev.stream()).0;
        if bytes.is_empty() {
            return Ok(ScratchUpload {
                _lock: state,
                address: 0,
                counter,
            });
        }
        // A status the driver cannot give counts as a capture: the copy is then made.
        let capturing = !matches!(
            dev.stream().capture_status(),
            Ok(CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        );
        if state.needs_copy(bytes, capturing) {
            state.held = None; // unknown until the copy is queued
            if state.buf.as_ref().is_none_or(|b| b.len() < bytes.len()) {
                let len = bytes.len().next_power_of_two().max(MIN_BYTES);
                // SAFETY: what a call reads is written by the copy below before any of its
                // launches; the old buffer (dropped here) is freed in stream order, after its
                // readers.
                state.buf = Some(unsafe { dev.stream().alloc::<u8>(len)? });
            }
            let buf = state.buf.as_mut().expect("allocated above");
            dev.stream().memcpy_htod(bytes.as_slice(), buf)?;
            state.held = Some(bytes.clone());
        }
        let buf = state.buf.as_ref().expect("copied now or before");
        let address = buf.device_ptr(dev.stream()).0;
        Ok(ScratchUpload {
            _lock: state,
            address,
            counter,
        })
    }
}

impl ScratchState {
    /// Whether `bytes` need a copy: the buffer holds other data (or nothing known), or the
    /// stream is being captured.
    fn needs_copy(&self, bytes: &[u8], capturing: bool) -> bool {
        capturing || self.held.as_deref() != Some(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::{LaunchBytes, ScratchState};

    #[test]
    fn a_copy_is_skipped_only_for_the_data_held_outside_a_capture() {
        let mut state = ScratchState::default();
        let (a, b) = ([1u8, 2, 3, 4], [1u8, 2, 3, 5]);
        assert!(state.needs_copy(&a, false), "nothing held yet");
        state.held = Some(a.to_vec());
        assert!(!state.needs_copy(&a, false));
        assert!(state.needs_copy(&a, true), "a capture records its copy");
        assert!(state.needs_copy(&b, false));
        assert!(state.needs_copy(&a[..3], false), "a prefix is other data");
        state.held = None; // a copy that failed
        assert!(state.needs_copy(&a, false));
    }

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
