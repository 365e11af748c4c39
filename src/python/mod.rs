//! The PyO3 layer: thin wrappers over [`crate::engine`] and [`crate::convert`].
//!
//! Compute runs with the interpreter detached (other Python threads keep
//! running); Ctrl-C is polled between tokens and chunks. Every Rust error
//! becomes one class of the hierarchy in `colibri/_errors.py`, mapped in
//! [`to_py`] and nowhere else.

use std::path::PathBuf;

use pyo3::exceptions::{PyKeyboardInterrupt, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::convert::{ConvertOptions, convert};
use crate::engine::{Engine, EngineOptions, GenerateOptions};
use crate::error::Error;
use crate::quant::DType;

/// Maps an error to its Python exception class.
fn to_py(e: Error) -> PyErr {
    let class = match &e {
        Error::Format { .. } => "FormatError",
        Error::Unsupported(_) => "UnsupportedModelError",
        Error::Checkpoint { .. } => "CheckpointError",
        Error::InvalidInput(_) => "InvalidInputError",
        Error::ContextOverflow(_) => "ContextLengthError",
        Error::OutputExists(_) => "OutputExistsError",
        Error::NotFound(_) => "ModelNotFoundError",
        Error::Io { .. } => "ColibriIOError",
        Error::Interrupted => return PyKeyboardInterrupt::new_err("generation interrupted"),
    };
    let msg = e.to_string();
    Python::attach(|py| {
        let cls = py.import("colibri._errors").and_then(|m| m.getattr(class));
        match cls {
            Ok(cls) => match cls.call1((msg.clone(),)) {
                Ok(inst) => PyErr::from_value(inst),
                Err(err) => err,
            },
            Err(_) => PyRuntimeError::new_err(msg),
        }
    })
}

/// Polls for Ctrl-C; only the main thread ever sees signals.
fn interrupted() -> bool {
    Python::attach(|py| py.check_signals().is_err())
}

/// Token ids from Python ints, refusing negatives here (ids too large are
/// refused by the forward pass, which knows the vocabulary).
fn to_ids(ids: Vec<i64>) -> Result<Vec<u32>, Error> {
    ids.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| Error::InvalidInput(format!("token id {t} at position {i} is out of range")))
        })
        .collect()
}

fn f32_bytes<'py>(py: Python<'py>, v: &[f32]) -> Bound<'py, PyByteArray> {
    PyByteArray::new(py, bytemuck::cast_slice(v))
}

/// Native engine; `colibri.Engine` wraps it and builds NumPy arrays.
#[pyclass(frozen, module = "colibri._colibri", name = "NativeEngine")]
struct NativeEngine {
    inner: Engine,
}

#[pymethods]
impl NativeEngine {
    #[new]
    #[pyo3(signature = (path, threads=None))]
    fn new(py: Python<'_>, path: PathBuf, threads: Option<usize>) -> PyResult<Self> {
        let inner = py.detach(|| Engine::open(&path, &EngineOptions { threads })).map_err(to_py)?;
        Ok(NativeEngine { inner })
    }

    /// Logits as a bytearray of f32, shape (T, V).
    fn logits<'py>(&self, py: Python<'py>, token_ids: Vec<i64>) -> PyResult<Bound<'py, PyByteArray>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let out = py.detach(|| self.inner.logits(&ids, &interrupted)).map_err(to_py)?;
        Ok(f32_bytes(py, &out))
    }

    /// Hidden states as a bytearray of f32, shape (L+1, T, D).
    fn hidden_states<'py>(&self, py: Python<'py>, token_ids: Vec<i64>) -> PyResult<Bound<'py, PyByteArray>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        let out = py.detach(|| self.inner.hidden_states(&ids, &interrupted)).map_err(to_py)?;
        Ok(f32_bytes(py, &out))
    }

    #[pyo3(signature = (token_ids, max_new_tokens, temperature, seed, stop_ids))]
    fn generate(
        &self,
        py: Python<'_>,
        token_ids: Vec<i64>,
        max_new_tokens: usize,
        temperature: f32,
        seed: u64,
        stop_ids: Vec<i64>,
    ) -> PyResult<Vec<u32>> {
        let ids = to_ids(token_ids).map_err(to_py)?;
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(to_py(Error::InvalidInput(format!(
                "temperature must be a finite number >= 0, got {temperature}"
            ))));
        }
        let stop_ids = stop_ids.into_iter().filter_map(|t| u32::try_from(t).ok()).collect();
        let opts = GenerateOptions { max_new_tokens, temperature, seed, stop_ids };
        py.detach(|| self.inner.generate(&ids, &opts, &interrupted, &mut |_| true)).map_err(to_py)
    }

    /// The metadata block as JSON text.
    fn metadata_json(&self) -> String {
        let meta = self.inner.model().file().meta();
        serde_json::json!({
            "architecture": meta.architecture,
            "config": meta.config,
            "weight_dtype": meta.weight_dtype,
            "source_config": meta.source.config,
            "generation_config": meta.source.generation_config,
            "tensors": meta.tensors.len(),
            "file_bytes": self.inner.model().file().file_len(),
        })
        .to_string()
    }

    #[getter]
    fn threads(&self) -> usize {
        self.inner.threads()
    }
}

/// Converts a Hugging Face folder to a .colibri file; returns a summary dict.
#[pyfunction]
#[pyo3(signature = (src, dst, dtype=None, force=false, progress=true))]
fn convert_checkpoint<'py>(
    py: Python<'py>,
    src: PathBuf,
    dst: PathBuf,
    dtype: Option<&str>,
    force: bool,
    progress: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let dtype = match dtype {
        None | Some("auto") => None,
        Some(s) => Some(DType::parse(s).ok_or_else(|| {
            let names: Vec<_> = DType::ALL.iter().map(|d| d.name()).collect();
            to_py(Error::InvalidInput(format!("unknown dtype {s:?}; choose one of auto, {}", names.join(", "))))
        })?),
    };
    let opts = ConvertOptions { dtype, force, progress };
    let report = py.detach(|| convert(&src, &dst, &opts, &interrupted)).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item("path", report.path)?;
    d.set_item("architecture", report.architecture)?;
    d.set_item("dtype", report.dtype.name())?;
    d.set_item("tensors", report.tensors)?;
    d.set_item("bytes", report.bytes)?;
    Ok(d)
}

/// Weight types `convert` can write, by name.
#[pyfunction]
fn supported_dtypes() -> Vec<&'static str> {
    DType::ALL.iter().map(|d| d.name()).collect()
}

/// Architectures the converter accepts.
#[pyfunction]
fn supported_architectures() -> Vec<&'static str> {
    crate::arch::REGISTRY.iter().map(|a| a.hf_class).collect()
}

#[pymodule]
fn _colibri(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeEngine>()?;
    m.add_function(wrap_pyfunction!(convert_checkpoint, m)?)?;
    m.add_function(wrap_pyfunction!(supported_architectures, m)?)?;
    m.add_function(wrap_pyfunction!(supported_dtypes, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
