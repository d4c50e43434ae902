//! `DeviceTensor<T>`: a strided view over device memory that this crate owns.

use crate::device::Device;
use crate::dtype::Element;
use crate::error::{FlashError, Result};
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use ndarray::{ArrayD, ArrayView, Dimension, IxDyn};
use std::sync::Arc;

/// A tensor in device memory: an owned buffer plus a shape, element strides and an element
/// offset. The last dimension must be contiguous (stride 1) for the attention kernels; other
/// strides are free (e.g. Q, K and V as views into one packed QKV buffer).
pub struct DeviceTensor<T> {
    buf: CudaSlice<T>,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// Row-major strides of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

fn checked_numel(shape: &[usize]) -> Result<usize> {
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| FlashError::TooLarge(format!("shape {shape:?} overflows usize")))
}

impl<T> DeviceTensor<T> {
    /// Whether two tensors view the same device buffer.
    pub fn same_buffer<U>(&self, other: &DeviceTensor<U>) -> bool {
        self.buf_addr() == other.buf_addr()
    }

    fn buf_addr(&self) -> u64 {
        self.buf.device_ptr(self.buf.stream()).0
    }
}

impl<T: Element> DeviceTensor<T> {
    /// A contiguous tensor of `shape`, zero-filled.
    pub fn zeros(dev: &Device, shape: &[usize]) -> Result<Self> {
        let n = checked_numel(shape)?;
        let buf = dev.stream().alloc_zeros::<T>(n)?;
        Ok(Self::contiguous(buf, shape))
    }

    fn contiguous(buf: CudaSlice<T>, shape: &[usize]) -> Self {
        Self {
            buf,
            strides: contiguous_strides(shape),
            shape: shape.to_vec(),
            offset: 0,
        }
    }

    /// A contiguous tensor of `shape` whose contents are undefined (for outputs that a kernel
    /// writes in full).
    pub(crate) fn uninit(dev: &Device, shape: &[usize]) -> Result<Self> {
        let n = checked_numel(shape)?;
        // SAFETY: callers hand the tensor to a kernel that writes every element before any read.
        let buf = unsafe { dev.stream().alloc::<T>(n)? };
        Ok(Self::contiguous(buf, shape))
    }

    /// A contiguous tensor of `shape` holding `data` (row-major).
    pub fn from_host(dev: &Device, shape: &[usize], data: &[T]) -> Result<Self> {
        let n = checked_numel(shape)?;
        if n != data.len() {
            return Err(FlashError::Shape(format!(
                "shape {shape:?} has {n} elements, data has {}",
                data.len()
            )));
        }
        let buf = dev.stream().clone_htod(data)?;
        Ok(Self::contiguous(buf, shape))
    }

    /// A contiguous copy of an ndarray on the device.
    pub fn from_ndarray<D: Dimension>(dev: &Device, a: ArrayView<T, D>) -> Result<Self> {
        let data: Vec<T> = a.iter().copied().collect();
        Self::from_host(dev, a.shape(), &data)
    }

    /// Reinterprets the buffer with another shape, element strides and element offset (a
    /// view, no copy). Fails if any element would lie outside the buffer.
    pub fn with_layout(
        mut self,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
    ) -> Result<Self> {
        if shape.len() != strides.len() {
            return Err(FlashError::Layout(format!(
                "shape {shape:?} and strides {strides:?} differ in rank"
            )));
        }
        if checked_numel(shape)? > 0 {
            let last = shape
                .iter()
                .zip(strides)
                .try_fold(offset, |acc, (&d, &s)| {
                    acc.checked_add((d - 1).checked_mul(s)?)
                })
                .ok_or_else(|| FlashError::TooLarge("layout overflows usize".into()))?;
            if last >= self.buf.len() {
                return Err(FlashError::Layout(format!(
                    "layout shape {shape:?} strides {strides:?} offset {offset} reaches element {last}, buffer has {}",
                    self.buf.len()
                )));
            }
        }
        self.shape = shape.to_vec();
        self.strides = strides.to_vec();
        self.offset = offset;
        Ok(self)
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element strides.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Element offset of the first element in the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The context the buffer belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.buf.context()
    }

    /// Device address of the first element (for kernel parameters).
    pub(crate) fn device_address(&self, dev: &Device) -> u64 {
        let (ptr, _sync) = self.buf.device_ptr(dev.stream());
        ptr + (self.offset * std::mem::size_of::<T>()) as u64
    }

    /// Copies the tensor to the host, in logical row-major order.
    pub fn to_host(&self, dev: &Device) -> Result<Vec<T>> {
        Ok(self.to_ndarray(dev)?.iter().copied().collect())
    }

    /// Copies the tensor to the host as an ndarray of its shape.
    pub fn to_ndarray(&self, dev: &Device) -> Result<ArrayD<T>> {
        let raw = dev.stream().clone_dtoh(&self.buf)?;
        let idx: Vec<usize> = self.shape.clone();
        Ok(ArrayD::from_shape_fn(IxDyn(&idx), |ix| {
            let at = (0..ix.ndim()).fold(self.offset, |a, d| a + ix[d] * self.strides[d]);
            raw[at]
        }))
    }

    /// Overwrites the whole buffer with NaN, so that a test sees any element a kernel fails to
    /// write.
    pub fn fill_nan(&mut self, dev: &Device) -> Result<()> {
        let nan = vec![T::nan(); self.buf.len()];
        dev.stream().memcpy_htod(&nan, &mut self.buf)?;
        Ok(())
    }
}
