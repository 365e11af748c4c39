//! The dense part (embeddings, attention, norms, routers, shared experts,
//! lm_head) copied into memory of its own when experts stream.
//!
//! With a RAM budget the model is bigger than the memory it may use, and a
//! mapping would leave the dense weights to the page cache: buffered expert
//! reads would push them out and every token would fault them back in from
//! disk, unseen by the store's counters. A private copy stays resident. It
//! also makes the streamed model independent of the file after open: a file
//! truncated or removed mid-run turns into read errors for the experts
//! instead of a SIGBUS on a mapped page.

use std::fs::File;

use crate::canonical::tensors::{ExpertTensor, TensorId};
use crate::error::{Error, Result};
use crate::format::TENSOR_ALIGN;
use crate::format::reader::ColibriFile;
use crate::io::{AlignedBuf, read_full};
use crate::kernels::Matrix;
use crate::model::weights::TensorRef;

/// Every non-expert tensor of a file, packed 64-byte aligned in one buffer.
pub(crate) struct DenseCopy {
    buf: AlignedBuf,
    /// By tensor index: offset in `buf`, or `None` for routed-expert tensors.
    at: Vec<Option<usize>>,
}

/// Indices of the routed experts' tensors in the file's tensor table.
fn expert_tensors(file: &ColibriFile) -> Vec<bool> {
    let mut is_expert = vec![false; file.meta().tensors.len()];
    for s in &file.meta().experts {
        for which in ExpertTensor::ALL.into_iter().chain(ExpertTensor::BIASES) {
            if let Some(i) = file.index_of(&TensorId::Expert(s.layer, s.expert, which).to_string()) {
                is_expert[i] = true;
            }
        }
    }
    is_expert
}

/// Bytes of the dense part (every tensor that is not a routed expert's).
pub(crate) fn dense_bytes(file: &ColibriFile) -> u64 {
    let is_expert = expert_tensors(file);
    file.meta().tensors.iter().zip(&is_expert).filter(|(_, x)| !**x).map(|(t, _)| t.nbytes).sum()
}

impl DenseCopy {
    /// Reads the dense tensors of `file` through `handle` (positioned reads,
    /// not the mapping, so a file truncated meanwhile is an error).
    pub(crate) fn read(file: &ColibriFile, handle: &File) -> Result<DenseCopy> {
        let is_expert = expert_tensors(file);
        let tensors = &file.meta().tensors;
        let mut at = vec![None; tensors.len()];
        let mut len = 0usize;
        for (i, t) in tensors.iter().enumerate() {
            if !is_expert[i] {
                at[i] = Some(len);
                len = (len + t.nbytes as usize).next_multiple_of(TENSOR_ALIGN as usize);
            }
        }
        let mut buf = AlignedBuf::zeroed(len)
            .ok_or_else(|| Error::InvalidInput(format!("cannot allocate {len} bytes for the model's dense weights")))?;
        let bytes = buf.as_mut_slice();
        for (t, off) in tensors.iter().zip(&at) {
            if let Some(off) = *off {
                let n = t.nbytes as usize;
                read_full(handle, &mut bytes[off..off + n], file.data_offset() + t.offset, n)
                    .map_err(|e| Error::io(file.path(), e))?;
            }
        }
        Ok(DenseCopy { buf, at })
    }

    /// The matrix view of a dense tensor reference.
    pub(crate) fn matrix(&self, file: &ColibriFile, t: TensorRef) -> Matrix<'_> {
        let e = &file.meta().tensors[t.idx];
        let off = self.at[t.idx].expect("dense tensor references only");
        let bytes = &self.buf.as_slice()[off..off + e.nbytes as usize];
        // Same length as in the file, and offsets keep the file's 64-byte alignment.
        Matrix::new(e.dtype, t.rows, t.cols, bytes).expect("validated at load")
    }
}
