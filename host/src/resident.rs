//! A block mask's words and the tile orders of a call's launches, kept on the device: uploaded
//! once per mask, stream and set of orders, then read in place by every later call that
//! matches (a model calls with the same mask layer after layer). Without it each call copies
//! the mask's words (64 KiB at 16K tokens and 16 heads) from pageable host memory before its
//! launches.

use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr};

use crate::device::Device;
use crate::error::Result;
use crate::sparse::{CallOrders, OrderKey};

/// One mask's device copies, the newest [`ResidentWords::KEEP`]: each the mask's words, then
/// the orders its keys name, on one stream.
#[derive(Default)]
pub(crate) struct ResidentWords(Mutex<Vec<Kept>>);

/// A device copy: the mask's words, then the orders of `orders`, allocated (and, when dropped,
/// freed) in the order of the stream that uploaded it.
struct Kept {
    orders: Vec<OrderKey>,
    buf: Arc<CudaSlice<u32>>,
}

/// The words a call reads on the device: where they and the orders after them start, and the
/// copy, which the call keeps until its launches are queued (the buffer's free is
/// stream-ordered after them).
pub(crate) struct DeviceWords {
    /// Device address of the mask's first word.
    pub address: u64,
    /// Device address of the first order's first word (0: the call has no orders).
    pub orders_address: u64,
    _buf: Arc<CudaSlice<u32>>,
}

impl ResidentWords {
    /// Copies kept per mask.
    const KEEP: usize = 8;

    /// The copy on `dev`'s stream of the orders `orders` (their keys) after `mask_words`
    /// words of the mask: kept from an earlier call, else uploaded (in stream order, before
    /// the launches that follow) from `words()` and kept.
    pub(crate) fn on_device(
        &self,
        dev: &Device,
        orders: &CallOrders,
        mask_words: usize,
        words: impl FnOnce() -> Vec<u32>,
    ) -> Result<DeviceWords> {
        let keys = || orders.iter().map(|(key, _)| key);
        let mut copies = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let kept = copies
            .iter()
            .find(|c| c.orders.iter().eq(keys()) && Arc::ptr_eq(c.buf.stream(), dev.stream()));
        let buf = match kept {
            Some(copy) => copy.buf.clone(),
            None => {
                let buf = Arc::new(dev.stream().clone_htod(&words())?);
                if copies.len() == Self::KEEP {
                    copies.remove(0);
                }
                copies.push(Kept {
                    orders: keys().copied().collect(),
                    buf: buf.clone(),
                });
                buf
            }
        };
        let address = buf.device_ptr(dev.stream()).0;
        let orders_address = match orders {
            [] => 0,
            _ => address + 4 * mask_words as u64,
        };
        Ok(DeviceWords {
            address,
            orders_address,
            _buf: buf,
        })
    }
}
