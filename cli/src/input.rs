//! Bounded readers for the CLI's inputs.
//!
//! Both formats start with a length-prefixed header that declares everything that follows, so
//! a reader needs never read more than that: the header length is capped before anything is
//! allocated, the data is read up to the declared size and no further, and a file that ends
//! early is a [`CliError::Truncated`]. A file or device that never ends (`/dev/zero`) thus
//! costs at most the cap, not all memory.

use crate::error::{CliError, Result};
use flash_attn::{DType, Element};
use half::{bf16, f16};
use ndarray::{Array, Array4, Dimension, IxDyn};
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};

/// Cap on a `.npy` header. NumPy itself refuses headers over 10 000 bytes by default
/// (`np.load(max_header_size=...)`); 1 MiB leaves room for any real array.
pub const MAX_NPY_HEADER: u64 = 1 << 20;

/// Cap on a safetensors JSON header: the limit the `safetensors` crate enforces itself.
pub const MAX_SAFETENSORS_HEADER: u64 = 100_000_000;

/// The `.npy` magic string.
const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// An element type the CLI reads and writes: its safetensors dtype and its little-endian
/// decoding, and its `.npy` encoding where NumPy has one.
pub trait FileElement: Element {
    /// The safetensors dtype.
    const ST_DTYPE: Dtype;
    /// Whether NumPy has this dtype (bf16: no), i.e. whether [`Self::write_npy`] writes.
    const HAS_NPY: bool;
    /// Decodes one element from its little-endian bytes (`b.len()` is the element size).
    fn from_le(b: &[u8]) -> Self;
    /// Appends the element's little-endian bytes.
    fn put_le(self, out: &mut Vec<u8>);
    /// Writes `values` (C order, `shape`) as a `.npy` file to `w`; `None` when NumPy has no
    /// such dtype (bf16).
    fn write_npy(
        w: &mut dyn std::io::Write,
        shape: &[usize],
        values: &[Self],
    ) -> Option<std::io::Result<()>>;
}

/// `.npy` writing through npyz for the element types that NumPy knows.
fn npyz_write<T: npyz::AutoSerialize + Copy>(
    w: &mut dyn std::io::Write,
    shape: &[usize],
    values: &[T],
) -> std::io::Result<()> {
    use npyz::WriterBuilder;
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut writer = npyz::WriteOptions::new()
        .default_dtype()
        .shape(&shape)
        .writer(w)
        .begin_nd()?;
    writer.extend(values.iter().copied())?;
    writer.finish()
}

/// `FileElement` for a type with `from_le_bytes`/`to_le_bytes`: its safetensors dtype, and
/// whether NumPy has it (bf16: no).
macro_rules! file_element {
    ($t:ty, $dtype:ident, npy = $npy:tt) => {
        impl FileElement for $t {
            const HAS_NPY: bool = $npy;
            const ST_DTYPE: Dtype = Dtype::$dtype;
            fn put_le(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn from_le(b: &[u8]) -> Self {
                <$t>::from_le_bytes(b.try_into().expect("one element's bytes"))
            }
            fn write_npy(
                w: &mut dyn std::io::Write,
                shape: &[usize],
                values: &[Self],
            ) -> Option<std::io::Result<()>> {
                file_element!(@npy $npy, w, shape, values)
            }
        }
    };
    (@npy true, $w:ident, $shape:ident, $values:ident) => {
        Some(npyz_write($w, $shape, $values))
    };
    (@npy false, $w:ident, $shape:ident, $values:ident) => {{
        let _ = ($w, $shape, $values);
        None
    }};
}

file_element!(f16, F16, npy = true);
file_element!(bf16, BF16, npy = false);
file_element!(f32, F32, npy = true);
file_element!(i32, I32, npy = true);

/// The floating-point element types of attention inputs.
pub const FLOAT_DTYPES: &[DType] = &[DType::F16, DType::BF16, DType::F32];

/// What [`read_safetensors`] says when a tensor is not one of [`FLOAT_DTYPES`].
pub const FLOAT_SUPPORTED: &str = "F16, BF16 or F32 is supported";

/// A tensor read from a file, before its element type is known statically.
#[derive(Debug)]
pub struct RawTensor {
    /// Its name in the safetensors file, or the `.npy` path.
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
    /// Its elements, little-endian, C order.
    pub bytes: Vec<u8>,
}

impl RawTensor {
    /// Decodes into a rank-4 array of `T` (whose dtype the caller has matched).
    pub fn to_array<T: FileElement>(&self) -> Result<Array4<T>> {
        let dims: [usize; 4] = self
            .shape
            .as_slice()
            .try_into()
            .map_err(|_| CliError::Rank {
                name: self.name.clone(),
                shape: self.shape.clone(),
            })?;
        let size = self.dtype.size();
        let data: Vec<T> = self.bytes.chunks_exact(size).map(T::from_le).collect();
        Array4::from_shape_vec(dims, data).map_err(|e| CliError::Format {
            path: self.name.clone().into(),
            message: e.to_string(),
        })
    }

    /// Decodes into an array of `T` of rank `D` (`layout`, such as `[B]`, names its dims in
    /// the error of another rank). Fails with [`CliError::Format`] (naming the tensor) when
    /// the tensor is not of `T`'s dtype or has another rank.
    pub fn to_array_nd<T: FileElement, D: Dimension>(&self, layout: &str) -> Result<Array<T, D>> {
        let error = |message: String| CliError::Format {
            path: format!("tensor `{}`", self.name).into(),
            message,
        };
        if self.dtype != T::DTYPE {
            return Err(error(format!(
                "is {:?}, expected {:?}",
                self.dtype,
                T::DTYPE
            )));
        }
        let rank = D::NDIM.unwrap_or(self.shape.len());
        if self.shape.len() != rank {
            return Err(error(format!(
                "must have rank {rank} {layout}, got shape {:?}",
                self.shape
            )));
        }
        let data: Vec<T> = self
            .bytes
            .chunks_exact(T::DTYPE.size())
            .map(T::from_le)
            .collect();
        Array::from_shape_vec(IxDyn(&self.shape), data)
            .and_then(|a| a.into_dimensionality::<D>())
            .map_err(|e| error(e.to_string()))
    }
}

/// An open input file and what is known of its length.
struct Source<'a> {
    path: &'a Path,
    file: File,
    /// The length of a regular file (`None` for pipes and devices).
    len: Option<u64>,
    /// Bytes consumed so far.
    pos: u64,
}

impl<'a> Source<'a> {
    fn open(path: &'a Path) -> Result<Self> {
        let io = |source| CliError::Io {
            path: path.into(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if meta.is_dir() {
            return Err(CliError::Format {
                path: path.into(),
                message: "is a directory".into(),
            });
        }
        Ok(Source {
            path,
            file,
            len: meta.is_file().then_some(meta.len()),
            pos: 0,
        })
    }

    /// Reads exactly `n` bytes, or fails with [`CliError::Truncated`] naming `what`. Memory
    /// grows with what arrives, not with `n`, so a bogus declared size cannot allocate much.
    fn read_exact(&mut self, n: u64, what: &'static str) -> Result<Vec<u8>> {
        let truncated = |got| CliError::Truncated {
            path: self.path.into(),
            what,
            expected: n,
            got,
        };
        if let Some(len) = self.len {
            if len.saturating_sub(self.pos) < n {
                return Err(truncated(len.saturating_sub(self.pos)));
            }
        }
        let mut buf = Vec::with_capacity(n.min(64 << 20) as usize);
        (&mut self.file)
            .take(n)
            .read_to_end(&mut buf)
            .map_err(|source| CliError::Io {
                path: self.path.into(),
                source,
            })?;
        self.pos += buf.len() as u64;
        if (buf.len() as u64) < n {
            return Err(truncated(buf.len() as u64));
        }
        Ok(buf)
    }

    /// Fails if anything follows what has been read.
    fn expect_end(&mut self) -> Result<()> {
        let mut one = [0u8; 1];
        let extra = loop {
            match self.file.read(&mut one) {
                Ok(n) => break n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(CliError::Io {
                        path: self.path.into(),
                        source,
                    })
                }
            }
        };
        if extra == 0 {
            return Ok(());
        }
        Err(CliError::TrailingData {
            path: self.path.into(),
            extra: self.len.map_or(1, |len| len.saturating_sub(self.pos)),
        })
    }
}

/// A safetensors file read through the bounded reader and validated, whose tensors are then
/// looked up by name (each copied out once when asked for).
pub struct SafetensorsFile {
    path: PathBuf,
    /// The whole file.
    bytes: Vec<u8>,
    /// The header's length in bytes (the data starts at `8 + header_len`).
    header_len: usize,
    metadata: Metadata,
}

impl SafetensorsFile {
    /// Reads and validates a whole safetensors file: the header length is capped
    /// ([`MAX_SAFETENSORS_HEADER`]) before anything is allocated, and the data is read up to
    /// the size the header declares and no further.
    pub fn read(path: &Path) -> Result<Self> {
        let mut src = Source::open(path)?;
        let prefix = src.read_exact(8, "the header length")?;
        let n = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
        if n > MAX_SAFETENSORS_HEADER {
            return Err(CliError::HeaderTooLarge {
                path: path.into(),
                len: n,
                max: MAX_SAFETENSORS_HEADER,
            });
        }
        let header = src.read_exact(n, "the header")?;
        let format = |message: String| CliError::Format {
            path: path.into(),
            message,
        };
        let metadata: Metadata = serde_json::from_slice(&header)
            .map_err(|e| format(format!("not a safetensors file (invalid header: {e})")))?;
        let data_len = metadata
            .tensors()
            .values()
            .map(|t| t.data_offsets.1)
            .max()
            .unwrap_or(0);
        let data = src.read_exact(data_len as u64, "the tensor data")?;
        src.expect_end()?;
        let mut bytes = prefix;
        bytes.extend_from_slice(&header);
        bytes.extend_from_slice(&data);
        drop(data);
        let (header_len, metadata) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| format(format!("not a valid safetensors file: {e}")))?;
        Ok(SafetensorsFile {
            path: path.into(),
            bytes,
            header_len,
            metadata,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of the tensors the file holds, sorted.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.metadata.tensors().into_keys().collect();
        names.sort();
        names
    }

    /// The tensor `name`, or `None` when the file has none of that name. Its dtype must be
    /// one of `accept` (F16, BF16, F32 or I32): any other is a [`CliError::UnsupportedDtype`]
    /// that says `supported`.
    pub fn tensor(
        &self,
        name: &str,
        accept: &[DType],
        supported: &'static str,
    ) -> Result<Option<RawTensor>> {
        let Some(info) = self.metadata.info(name) else {
            return Ok(None);
        };
        let dtype = match info.dtype {
            Dtype::F16 => Some(DType::F16),
            Dtype::BF16 => Some(DType::BF16),
            Dtype::F32 => Some(DType::F32),
            Dtype::I32 => Some(DType::I32),
            _ => None,
        };
        let Some(dtype) = dtype.filter(|d| accept.contains(d)) else {
            return Err(CliError::UnsupportedDtype {
                path: self.path.clone(),
                dtype: format!("{} (tensor `{name}`)", info.dtype),
                supported,
            });
        };
        let (start, end) = info.data_offsets;
        let base = 8 + self.header_len;
        Ok(Some(RawTensor {
            name: name.to_string(),
            dtype,
            shape: info.shape.clone(),
            bytes: self.bytes[base + start..base + end].to_vec(),
        }))
    }
}

/// Reads the tensors `names` (Q, K, V, and dO for the backward pass) from a safetensors file;
/// each must be F16, BF16 or F32.
pub fn read_safetensors<const N: usize>(
    path: &Path,
    names: &[String; N],
) -> Result<[RawTensor; N]> {
    let file = SafetensorsFile::read(path)?;
    let mut tensors = Vec::with_capacity(N);
    for name in names {
        let tensor = file.tensor(name, FLOAT_DTYPES, FLOAT_SUPPORTED)?;
        tensors.push(tensor.ok_or_else(|| CliError::MissingTensor {
            path: path.into(),
            name: name.clone(),
            have: file.names().join(", "),
        })?);
    }
    Ok(tensors
        .try_into()
        .unwrap_or_else(|_| unreachable!("one tensor per name")))
}

/// Reads a `.npy` file: format 1.0 to 3.0, little-endian `<f2` (f16) or `<f4` (f32), C order.
///
/// npyz parses the header (a Python dict literal); the magic, version and header length are
/// read here first so that the length is capped before npyz allocates the header.
pub fn read_npy(path: &Path) -> Result<RawTensor> {
    let mut src = Source::open(path)?;
    let format = |message: String| CliError::Format {
        path: path.into(),
        message,
    };
    // Magic and version: 8 bytes. A shorter file that starts like the magic is truncated;
    // anything else is not a .npy file.
    let mut pre = Vec::new();
    (&mut src.file)
        .take(8)
        .read_to_end(&mut pre)
        .map_err(|source| CliError::Io {
            path: path.into(),
            source,
        })?;
    src.pos = pre.len() as u64;
    let magic_len = pre.len().min(NPY_MAGIC.len());
    if pre[..magic_len] != NPY_MAGIC[..magic_len] || pre.is_empty() {
        return Err(format("not a .npy file (bad magic)".into()));
    }
    if pre.len() < 8 {
        return Err(CliError::Truncated {
            path: path.into(),
            what: "the magic string and version",
            expected: 8,
            got: pre.len() as u64,
        });
    }
    let len_size = match (pre[6], pre[7]) {
        (1, 0) => 2,
        (2 | 3, 0) => 4,
        (major, minor) => {
            return Err(format(format!(
                "unsupported .npy format version {major}.{minor} (1.0, 2.0 and 3.0 are supported)"
            )))
        }
    };
    let len_bytes = src.read_exact(len_size, "the header length")?;
    let header_len = len_bytes
        .iter()
        .rev()
        .fold(0u64, |acc, &b| (acc << 8) | u64::from(b));
    if header_len > MAX_NPY_HEADER {
        return Err(CliError::HeaderTooLarge {
            path: path.into(),
            len: header_len,
            max: MAX_NPY_HEADER,
        });
    }
    let text = src.read_exact(header_len, "the header")?;
    let mut whole_header = pre;
    whole_header.extend_from_slice(&len_bytes);
    whole_header.extend_from_slice(&text);
    let header = npyz::NpyHeader::from_reader(whole_header.as_slice())
        .map_err(|e| format(format!("bad .npy header: {e}")))?;
    let descr = header.dtype().descr();
    let descr = descr.trim_matches('\'');
    let dtype = match descr {
        "<f2" => DType::F16,
        "<f4" => DType::F32,
        d => {
            return Err(CliError::UnsupportedDtype {
                path: path.into(),
                dtype: format!("'{d}'"),
                supported: match d {
                    ">f2" | ">f4" => "big-endian arrays are not supported ('<f2' f16 or '<f4' f32 only)",
                    _ => "'<f2' (f16) or '<f4' (f32) only; NumPy has no bf16, store bf16 in a safetensors file",
                },
            })
        }
    };
    if header.order() == npyz::Order::Fortran {
        return Err(format(
            "Fortran-order arrays are not supported (save with np.ascontiguousarray)".into(),
        ));
    }
    let shape = header
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| format(format!("shape {:?} overflows", header.shape())))?;
    let n_bytes = shape
        .iter()
        .try_fold(dtype.size() as u64, |a, &d| a.checked_mul(d as u64))
        .ok_or_else(|| format(format!("shape {shape:?} overflows")))?;
    let bytes = src.read_exact(n_bytes, "the array data")?;
    src.expect_end()?;
    Ok(RawTensor {
        name: path.display().to_string(),
        dtype,
        shape,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("flash-attn-cli-unit-{}-{name}", std::process::id()))
    }

    /// What npyz writes, the bounded reader reads back: NumPy's layout, data 64-byte aligned.
    #[test]
    fn npy_round_trip() {
        let path = temp("rt.npy");
        let vals: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut bytes = Vec::new();
        f32::write_npy(&mut bytes, &[1, 2, 3, 4], &vals)
            .expect("f32 has a .npy dtype")
            .unwrap();
        let header_end = 10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!(header_end % 64, 0);
        std::fs::write(&path, &bytes).unwrap();
        let t = read_npy(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            (t.dtype, t.shape.as_slice()),
            (DType::F32, &[1, 2, 3, 4][..])
        );
        let a = t.to_array::<f32>().unwrap();
        assert_eq!(a.iter().copied().collect::<Vec<_>>(), vals);
        assert!(bf16::write_npy(&mut Vec::new(), &[1], &[bf16::ONE]).is_none());
    }

    /// Format 2.0 (4-byte header length) and a double-quoted header dict read too.
    #[test]
    fn npy_version_2() {
        let path = temp("v2.npy");
        let mut header =
            "{\"descr\": \"<f2\", \"fortran_order\": False, \"shape\": (2,), }".to_string();
        while (12 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut b = b"\x93NUMPY\x02\x00".to_vec();
        b.extend_from_slice(&(header.len() as u32).to_le_bytes());
        b.extend_from_slice(header.as_bytes());
        b.extend_from_slice(&f16::ONE.to_le_bytes());
        b.extend_from_slice(&f16::NEG_ONE.to_le_bytes());
        std::fs::write(&path, &b).unwrap();
        let t = read_npy(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!((t.dtype, t.shape.as_slice()), (DType::F16, &[2][..]));
        assert_eq!(t.bytes, b[b.len() - 4..]);
    }
}
