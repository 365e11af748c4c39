//! Architecture adapters: the ONLY code that knows Hugging Face names and quirks.
//!
//! Each supported `*ForCausalLM` class is one file here exporting an [`Arch`]:
//! a function from `config.json` to the canonical [`ModelConfig`], and a
//! function from a canonical [`TensorId`] to the [`Source`] that holds it in
//! the Hub checkpoint (a tensor as it is, or a slice, transpose or row pick
//! of one; FP8 and MXFP4 sources are dequantised by the reader whatever the
//! mapping). [`REGISTRY`] is the single table keyed by class name; nothing
//! else in the crate matches on the architecture.

mod deepseek;
mod deepseek_v32;
mod deepseek_v4;
mod dots1;
mod ernie4_5_moe;
mod gemma4;
mod glm4_moe;
mod glm4_moe_lite;
mod glm_moe_dsa;
mod gpt_oss;
mod granitemoe;
mod granitemoehybrid;
mod kimi_k25;
mod kimi_linear;
mod minimax_m2;
mod minimax_m3;
mod mistral4;
mod mixtral;
mod nemotron_h;
mod olmoe;
mod phimoe;
mod qwen2_moe;
mod qwen3_moe;
mod qwen3_next;

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::canonical::config::{
    FfnSpec, LayerSpec, LinearSpec, MixerSpec, ModelConfig, RopeScaling, RopeSpec, SIZE_LIMIT,
};
use crate::canonical::tensors::{ExpertTensor, LayerTensor, TensorId};
use crate::error::{Error, Result};

/// One supported Hugging Face architecture.
pub struct Arch {
    /// The class name in `config.json`'s `architectures` list.
    pub hf_class: &'static str,
    /// The `model_type` field, accepted when `architectures` is absent.
    pub model_type: &'static str,
    /// Maps config.json to the canonical config.
    pub config: fn(&HfConfig) -> Result<ModelConfig>,
    /// Where a canonical tensor comes from in the Hub checkpoint.
    pub source: fn(&HfConfig, &ModelConfig, TensorId) -> Source,
    /// Hub tensors the engine does not use and the converter may skip (e.g.
    /// DeepSeek-V3's multi-token-prediction layer); every other unused
    /// tensor is an error.
    pub ignored: fn(&HfConfig, &str) -> bool,
}

/// For adapters whose checkpoints hold nothing to skip.
pub(crate) fn nothing_ignored(_: &HfConfig, _: &str) -> bool {
    false
}

/// How one canonical tensor is cut out of one Hub tensor. The steps apply in
/// this order: take `index` of the first axis, transpose the 2-D rest, keep
/// the rows `rows` picks, transpose each picked block. Most tensors use none
/// of them ([`Source::tensor`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The Hub tensor's name.
    pub name: String,
    /// Slice `i` of a stacked `[E, ...]` tensor (one expert of all).
    pub index: Option<usize>,
    /// The tensor is `[in, out]`; transpose it to `[out, in]`.
    pub transpose: bool,
    /// Keep only some rows.
    pub rows: Option<RowPick>,
    /// Transpose each `[len, cols]` block that `rows` picked into `[cols, len]`.
    pub transpose_blocks: bool,
    /// Add 1 to every value, in f32 after decoding: a zero-centred norm
    /// scale (`x · (1 + w)`, Qwen3-Next) stored as the plain scale `1 + w`.
    pub add_one: bool,
    /// Where the tensor is when the checkpoint has no tensor `name` (a
    /// family whose checkpoints come in two layouts, e.g. per-expert and
    /// stacked experts).
    pub otherwise: Option<Box<Source>>,
}

/// Rows `r` with `r % period` in `offset..offset + len`, in order: every other
/// row of an interleaved gate/up pair (period 2, len 1), one half of a
/// concatenated pair (period = all rows), or one part of each head's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowPick {
    /// Length of the repeating pattern, in rows.
    pub period: usize,
    /// First kept row of each period.
    pub offset: usize,
    /// Kept rows per period.
    pub len: usize,
}

impl Source {
    /// The Hub tensor as it is.
    pub fn tensor(name: impl Into<String>) -> Source {
        Source {
            name: name.into(),
            index: None,
            transpose: false,
            rows: None,
            transpose_blocks: false,
            add_one: false,
            otherwise: None,
        }
    }

    /// Slice `i` of a stacked tensor.
    pub fn expert(name: impl Into<String>, i: usize) -> Source {
        Source { index: Some(i), ..Source::tensor(name) }
    }

    /// Also transposed.
    pub fn transposed(self) -> Source {
        Source { transpose: true, ..self }
    }

    /// Keeping only the rows `pick` selects.
    pub fn rows(self, period: usize, offset: usize, len: usize) -> Source {
        Source { rows: Some(RowPick { period, offset, len }), ..self }
    }

    /// With 1 added to every value.
    pub fn plus_one(self) -> Source {
        Source { add_one: true, ..self }
    }

    /// Falling back to `alt` when the checkpoint has no tensor of this name.
    pub fn or(self, alt: Source) -> Source {
        Source { otherwise: Some(Box::new(alt)), ..self }
    }

    /// The first of this source and its fallbacks whose tensor `exists`
    /// (this one when none does, so a missing tensor is reported by its
    /// first name).
    pub fn resolve(self, exists: impl Fn(&str) -> bool) -> Source {
        let mut s = &self;
        loop {
            if exists(&s.name) {
                return Source { otherwise: None, ..s.clone() };
            }
            match &s.otherwise {
                Some(alt) => s = alt,
                None => return self,
            }
        }
    }

    /// True when the tensor is used exactly as stored.
    pub fn is_whole(&self) -> bool {
        self.index.is_none() && !self.transpose && self.rows.is_none() && !self.transpose_blocks && !self.add_one
    }
}

/// Every supported architecture.
pub static REGISTRY: &[&Arch] = &[
    &mixtral::ARCH,
    &qwen2_moe::ARCH,
    &qwen3_moe::ARCH,
    &olmoe::ARCH,
    &deepseek::V2,
    &deepseek::V3,
    &gpt_oss::ARCH,
    &glm4_moe::ARCH,
    &glm4_moe_lite::ARCH,
    &dots1::ARCH,
    &mistral4::ARCH,
    &mistral4::MISTRAL3,
    &granitemoe::ARCH,
    &phimoe::ARCH,
    &qwen3_next::NEXT,
    &qwen3_next::QWEN3_5,
    &qwen3_next::QWEN3_5_VL,
    &kimi_linear::ARCH,
    &minimax_m2::ARCH,
    &ernie4_5_moe::ARCH,
    &gemma4::GEMMA4,
    &gemma4::GEMMA4_TEXT,
    &kimi_k25::ARCH,
    &deepseek_v32::ARCH,
    &deepseek_v4::ARCH,
    &glm_moe_dsa::ARCH,
    &nemotron_h::ARCH,
    &granitemoehybrid::ARCH,
    &minimax_m3::ARCH,
    &minimax_m3::TEXT,
];

/// Comma-separated class names, for error messages and docs.
pub fn supported_list() -> String {
    REGISTRY.iter().map(|a| a.hf_class).collect::<Vec<_>>().join(", ")
}

/// Finds the adapter for a checkpoint's config.json.
pub fn lookup(cfg: &HfConfig) -> Result<&'static Arch> {
    let classes: Vec<&str> = match cfg.raw.get("architectures") {
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    let model_type = cfg.raw.get("model_type").and_then(Value::as_str);
    for c in &classes {
        if let Some(a) = REGISTRY.iter().find(|a| a.hf_class == *c) {
            return Ok(a);
        }
    }
    if classes.is_empty()
        && let Some(a) = REGISTRY.iter().find(|a| Some(a.model_type) == model_type)
    {
        return Ok(a);
    }
    let named = if !classes.is_empty() {
        classes.join(", ")
    } else {
        model_type.unwrap_or("(no `architectures` or `model_type` in config.json)").to_string()
    };
    Err(Error::Unsupported(format!(
        "{}: architecture {named} is not supported; supported architectures: {}",
        cfg.path.display(),
        supported_list()
    )))
}

/// Python's `json` writes infinite and NaN floats as the bare words
/// `Infinity`, `-Infinity` and `NaN` (Nemotron-H's `time_step_limit`), which
/// strict JSON refuses. Each such word standing as a value (after `:`, `[` or
/// `,`, and not followed by `:`) becomes a string marked with a leading NUL,
/// which [`HfConfig::opt_f64`] reads back as the number; everything else,
/// strings included, is left for the JSON parser to judge, so text that is
/// malformed otherwise is still refused.
fn quote_python_constants(text: &str) -> std::borrow::Cow<'_, str> {
    const WORDS: [&str; 3] = ["-Infinity", "Infinity", "NaN"];
    if !WORDS.iter().any(|w| text.contains(w)) {
        return text.into();
    }
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 16);
    let (mut i, mut in_string, mut last) = (0, false, b' ');
    while i < bytes.len() {
        let b = bytes[i];
        if in_string {
            match b {
                b'\\' => {
                    out.push_str(&text[i..(i + 2).min(bytes.len())]);
                    i += 2;
                    continue;
                }
                b'"' => in_string = false,
                _ => {}
            }
        } else if b == b'"' {
            in_string = true;
        } else if matches!(last, b':' | b'[' | b',')
            && let Some(w) = WORDS.iter().find(|w| text[i..].starts_with(**w))
        {
            let rest = text[i + w.len()..].trim_start();
            if !rest.starts_with(':') {
                out.push_str(&format!("\"\\u0000{w}\""));
                i += w.len();
                last = b'"';
                continue;
            }
        }
        // Multi-byte characters are copied whole.
        let len = text[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&text[i..i + len]);
        if !b.is_ascii_whitespace() {
            last = b;
        }
        i += len;
    }
    out.into()
}

/// The number a marked Python constant stands for (see [`quote_python_constants`]).
fn python_constant(v: &Value) -> Option<f64> {
    match v.as_str()?.strip_prefix('\0')? {
        "Infinity" => Some(f64::INFINITY),
        "-Infinity" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => None,
    }
}

/// A parsed config.json with typed accessors whose errors name the field and file.
pub struct HfConfig {
    /// The whole JSON object.
    pub raw: Value,
    /// Where it came from (for messages).
    pub path: PathBuf,
}

impl HfConfig {
    /// Parses config.json text.
    pub fn parse(path: &Path, text: &str) -> Result<HfConfig> {
        let raw: Value = serde_json::from_str(&quote_python_constants(text))
            .map_err(|e| Error::checkpoint(path, format!("config.json is not valid JSON: {e}")))?;
        if !raw.is_object() {
            return Err(Error::checkpoint(path, "config.json is not a JSON object"));
        }
        Ok(HfConfig { raw, path: path.to_path_buf() })
    }

    fn err(&self, msg: String) -> Error {
        Error::checkpoint(&self.path, msg)
    }

    /// The value of `key`, treating JSON null as absent.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.raw.get(key).filter(|v| !v.is_null())
    }

    /// An optional non-negative integer.
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.err(format!("config field `{key}` must be a non-negative integer, got {v}"))),
        }
    }

    /// A required non-negative integer, looked up under the first present
    /// spelling. These are the model's sizes (widths, heads, layers, experts,
    /// vocabulary, context), which adapters allocate by: above
    /// [`SIZE_LIMIT`] one is refused here, before any allocation.
    pub fn usize(&self, keys: &[&str]) -> Result<usize> {
        for k in keys {
            if let Some(v) = self.opt_usize(k)? {
                if v > SIZE_LIMIT {
                    return Err(
                        self.err(format!("config field `{k}` = {v} is implausibly large (more than {SIZE_LIMIT})"))
                    );
                }
                return Ok(v);
            }
        }
        Err(self.err(format!("config.json has no `{}`", keys.join("` or `"))))
    }

    /// An optional number (Python's bare `Infinity`, `-Infinity` and `NaN`
    /// included, as the reader kept them).
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => python_constant(v)
                .or_else(|| v.as_f64())
                .map(Some)
                .ok_or_else(|| self.err(format!("config field `{key}` must be a number, got {v}"))),
        }
    }

    /// An optional list of numbers (Python's bare constants included).
    pub fn opt_f64_list(&self, key: &str) -> Result<Option<Vec<f64>>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        let bad = || self.err(format!("config field `{key}` must be a list of numbers, got {v}"));
        let list = v.as_array().ok_or_else(bad)?;
        list.iter().map(|x| python_constant(x).or_else(|| x.as_f64()).ok_or_else(bad)).collect::<Result<_>>().map(Some)
    }

    /// An optional boolean with a default.
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => {
                v.as_bool().ok_or_else(|| self.err(format!("config field `{key}` must be true or false, got {v}")))
            }
        }
    }

    /// A list of non-negative integers (absent = empty).
    pub fn usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|x| x as usize)
                        .ok_or_else(|| self.err(format!("`{key}` must list integers, got {v}")))
                })
                .collect(),
            Some(v) => Err(self.err(format!("config field `{key}` must be a list, got {v}"))),
        }
    }

    /// A required string field.
    pub fn str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// The `quant_method` of `quantization_config`, if the checkpoint declares one.
    pub fn quant_method(&self) -> Option<&str> {
        self.get("quantization_config").and_then(|q| q.get("quant_method")).and_then(Value::as_str)
    }

    /// Refuses an activation other than SiLU (the only one these families use).
    pub fn require_silu(&self, key: &str) -> Result<()> {
        match self.get(key).and_then(Value::as_str) {
            None | Some("silu") | Some("swish") => Ok(()),
            Some(other) => Err(Error::Unsupported(format!(
                "{}: {key} = \"{other}\" is not supported (only silu)",
                self.path.display()
            ))),
        }
    }

    /// The head width: `head_dim` when given, else hidden / heads.
    pub fn head_dim(&self, hidden: usize, heads: usize) -> Result<usize> {
        match self.opt_usize("head_dim")? {
            Some(h) => Ok(h),
            None if heads > 0 && hidden.is_multiple_of(heads) => Ok(hidden / heads),
            None => Err(self.err(format!("hidden_size {hidden} is not divisible by num_attention_heads {heads}"))),
        }
    }

    /// RoPE parameters from either spelling: transformers 4 (`rope_theta` +
    /// `rope_scaling`) or transformers 5 (`rope_parameters`).
    pub fn rope(&self, head_dim: usize, default_theta: f64) -> Result<RopeSpec> {
        let params = self.get("rope_parameters").filter(|v| v.is_object());
        let scaling = self.get("rope_scaling").filter(|v| v.is_object());
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(self.opt_f64("rope_theta")?)
            .unwrap_or(default_theta);
        let partial = params
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or(self.opt_f64("partial_rotary_factor")?)
            .unwrap_or(1.0);
        let rotary_dim = ((head_dim as f64 * partial) as usize) & !1;
        let p = scaling.or(params);
        let kind =
            p.and_then(|p| p.get("rope_type").or_else(|| p.get("type"))).and_then(Value::as_str).unwrap_or("default");
        let num = |k: &str| p.and_then(|p| p.get(k)).and_then(Value::as_f64);
        let need = |k: &str| num(k).ok_or_else(|| self.err(format!("rope scaling `{kind}` needs `{k}`")));
        let max_pos = self.opt_usize("max_position_embeddings")?.unwrap_or(0);
        let scaling = match kind {
            "default" | "none" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: need("factor")? },
            "yarn" => {
                // A top-level `original_max_position_embeddings` wins over the
                // one inside the scaling dict (transformers, for Phi-3 style configs).
                let original = match (
                    self.opt_usize("original_max_position_embeddings")?,
                    num("original_max_position_embeddings"),
                ) {
                    (Some(o), _) => o,
                    (None, Some(o)) => o as usize,
                    (None, None) => max_pos,
                };
                if original == 0 {
                    return Err(self.err(
                        "yarn rope scaling needs original_max_position_embeddings or max_position_embeddings".into(),
                    ));
                }
                let factor = num("factor").unwrap_or(max_pos as f64 / original as f64);
                let get_mscale =
                    |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * crate::math::ln(scale) + 1.0 };
                let attention_factor = match (num("attention_factor"), num("mscale"), num("mscale_all_dim")) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                        get_mscale(factor, m) / get_mscale(factor, ma)
                    }
                    _ => get_mscale(factor, 1.0),
                };
                let truncate = p.and_then(|p| p.get("truncate")).and_then(Value::as_bool).unwrap_or(true);
                let beta = |k: &str, d: f64| num(k).filter(|&b| b != 0.0).unwrap_or(d);
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: beta("beta_fast", 32.0),
                    beta_slow: beta("beta_slow", 1.0),
                    attention_factor,
                    truncate,
                }
            }
            "longrope" => {
                let list = |k: &str| -> Result<Vec<f64>> {
                    p.and_then(|p| p.get(k))
                        .and_then(Value::as_array)
                        .and_then(|a| a.iter().map(Value::as_f64).collect::<Option<Vec<f64>>>())
                        .ok_or_else(|| self.err(format!("longrope scaling needs `{k}` as a list of numbers")))
                };
                let original = match (
                    self.opt_usize("original_max_position_embeddings")?,
                    num("original_max_position_embeddings"),
                ) {
                    (Some(o), _) => o,
                    (None, Some(o)) => o as usize,
                    (None, None) => {
                        return Err(self.err("longrope scaling needs original_max_position_embeddings".into()));
                    }
                };
                // transformers' default attention factor, used when no mscale is given.
                let factor = num("factor").unwrap_or(max_pos as f64 / original.max(1) as f64);
                let default = num("attention_factor").unwrap_or(if factor <= 1.0 {
                    1.0
                } else {
                    (1.0 + crate::math::ln(factor) / crate::math::ln(original as f64)).sqrt()
                });
                RopeScaling::LongRope {
                    short_factor: list("short_factor")?,
                    long_factor: list("long_factor")?,
                    original_max_position_embeddings: original,
                    short_mscale: num("short_mscale").unwrap_or(default),
                    long_mscale: num("long_mscale").unwrap_or(default),
                }
            }
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: need("original_max_position_embeddings")? as usize,
            },
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: rope scaling type \"{other}\" is not supported (supported: default, linear, yarn, longrope, llama3)",
                    self.path.display()
                )));
            }
        };
        Ok(RopeSpec { theta, rotary_dim, scaling, interleaved: false })
    }
}

/// The Llama-family names shared by every supported architecture for the
/// embedding, norms, attention and lm_head. `None` for MoE/FFN tensors, which
/// each adapter names itself.
pub(crate) fn llama_name(id: TensorId) -> Option<String> {
    let bias = |n: String| n.strip_suffix(".weight").map(|b| format!("{b}.bias"));
    use LayerTensor as L;
    Some(match id {
        TensorId::Embed => "model.embed_tokens.weight".into(),
        TensorId::FinalNorm => "model.norm.weight".into(),
        TensorId::FinalNormBias => "model.norm.bias".into(),
        TensorId::LmHead => "lm_head.weight".into(),
        TensorId::LmHeadBias => "lm_head.bias".into(),
        // The converter names them by the checkpoint's MTP layout.
        TensorId::Mtp(_) | TensorId::HcHeadFn | TensorId::HcHeadBase | TensorId::HcHeadScale => return None,
        TensorId::Layer(l, t) => {
            let p = format!("model.layers.{l}");
            match t {
                L::AttnNorm => format!("{p}.input_layernorm.weight"),
                L::AttnNormBias => bias(format!("{p}.input_layernorm.weight"))?,
                L::FfnNorm => format!("{p}.post_attention_layernorm.weight"),
                L::FfnNormBias => bias(format!("{p}.post_attention_layernorm.weight"))?,
                L::Sinks => format!("{p}.self_attn.sinks"),
                L::Wq => format!("{p}.self_attn.q_proj.weight"),
                L::Wk => format!("{p}.self_attn.k_proj.weight"),
                L::Wv => format!("{p}.self_attn.v_proj.weight"),
                L::Wo => format!("{p}.self_attn.o_proj.weight"),
                L::Bq => format!("{p}.self_attn.q_proj.bias"),
                L::Bk => format!("{p}.self_attn.k_proj.bias"),
                L::Bv => format!("{p}.self_attn.v_proj.bias"),
                L::Bo => format!("{p}.self_attn.o_proj.bias"),
                L::QNorm => format!("{p}.self_attn.q_norm.weight"),
                L::KNorm => format!("{p}.self_attn.k_norm.weight"),
                L::Gate => format!("{p}.mlp.gate_proj.weight"),
                L::Up => format!("{p}.mlp.up_proj.weight"),
                L::Down => format!("{p}.mlp.down_proj.weight"),
                _ => return None,
            }
        }
        TensorId::Expert(..) => return None,
    })
}

/// Names of the `mlp.gate` / `mlp.experts.E.{gate,up,down}_proj` MoE layout
/// used by Qwen2-MoE, Qwen3-MoE and OLMoE.
pub(crate) fn qwen_moe_name(id: TensorId) -> Option<String> {
    use LayerTensor as L;
    Some(match id {
        TensorId::Layer(l, L::Router) => format!("model.layers.{l}.mlp.gate.weight"),
        TensorId::Layer(l, L::RouterBias) => format!("model.layers.{l}.mlp.gate.bias"),
        TensorId::Layer(l, L::RouterCorrection) => format!("model.layers.{l}.mlp.gate.e_score_correction_bias"),
        TensorId::Layer(l, L::SharedGate) => format!("model.layers.{l}.mlp.shared_expert.gate_proj.weight"),
        TensorId::Layer(l, L::SharedUp) => format!("model.layers.{l}.mlp.shared_expert.up_proj.weight"),
        TensorId::Layer(l, L::SharedDown) => format!("model.layers.{l}.mlp.shared_expert.down_proj.weight"),
        TensorId::Layer(l, L::SharedExpertGate) => format!("model.layers.{l}.mlp.shared_expert_gate.weight"),
        TensorId::Expert(l, e, t) => {
            let (n, kind) = expert_part(t, ["gate_proj", "up_proj", "down_proj"]);
            format!("model.layers.{l}.mlp.experts.{e}.{n}.{kind}")
        }
        _ => return None,
    })
}

/// The Hub module and parameter of one tensor of a per-expert checkpoint,
/// given the family's module names for gate, up and down: (`w1`, `weight`).
pub(crate) fn expert_part(t: ExpertTensor, [gate, up, down]: [&'static str; 3]) -> (&'static str, &'static str) {
    use ExpertTensor as X;
    match t {
        X::Gate => (gate, "weight"),
        X::Up => (up, "weight"),
        X::Down => (down, "weight"),
        X::GateBias => (gate, "bias"),
        X::UpBias => (up, "bias"),
        X::DownBias => (down, "bias"),
    }
}

/// The language model's config: `text_config` of a conditional-generation
/// checkpoint (with the top level's `tie_word_embeddings` when it has none),
/// else the file itself.
pub(crate) fn text_config(hf: &HfConfig) -> HfConfig {
    match hf.get("text_config") {
        Some(Value::Object(t)) => {
            let mut raw = t.clone();
            if let Some(tie) = hf.get("tie_word_embeddings")
                && !raw.contains_key("tie_word_embeddings")
            {
                raw.insert("tie_word_embeddings".into(), tie.clone());
            }
            HfConfig { raw: Value::Object(raw), path: hf.path.clone() }
        }
        _ => HfConfig { raw: hf.raw.clone(), path: hf.path.clone() },
    }
}

/// `n` layers of which the first `dense` are dense MLPs of `dense_ffn` and the
/// rest MoE, no sliding window (DeepSeek's and GLM's `first_k_dense_replace`).
pub(crate) fn leading_dense_layers(n: usize, dense: usize, dense_ffn: usize) -> Vec<LayerSpec> {
    (0..n)
        .map(|l| LayerSpec {
            mixer: MixerSpec::FULL_ATTENTION,
            ffn: if l < dense { FfnSpec::Dense { ffn_dim: dense_ffn } } else { FfnSpec::Moe },
        })
        .collect()
}

/// DeepSeek's and GLM's shared experts: `mlp.shared_experts.{gate,up,down}_proj`.
pub(crate) fn shared_experts_name(id: TensorId) -> Option<String> {
    let (l, w) = match id {
        TensorId::Layer(l, LayerTensor::SharedGate) => (l, "gate_proj"),
        TensorId::Layer(l, LayerTensor::SharedUp) => (l, "up_proj"),
        TensorId::Layer(l, LayerTensor::SharedDown) => (l, "down_proj"),
        _ => return None,
    };
    Some(format!("model.layers.{l}.mlp.shared_experts.{w}.weight"))
}

/// A Mamba2 mixer's own tensor `t` (Nemotron-H, Granite 4.0-H), cut from
/// the Hub's tensors of its layer, which `mixer` finds by their suffix:
/// `in_proj` rows are `[z (I), x (I), B (G·N), C (G·N), dt (H)]` and the
/// convolution's channels `[x, B, C]`. `None` for a tensor that is not the
/// mixer's own (its out_proj is named by the caller, as a layer's output).
pub(crate) fn mamba2_source(lin: Option<LinearSpec>, t: LayerTensor, mixer: impl Fn(&str) -> Source) -> Option<Source> {
    use LayerTensor as L;
    let (i, gn, hv) = lin.map_or((1, 1, 1), |s| (s.value_dim(), s.key_dim(), s.v_heads));
    let (proj, conv) = (2 * i + 2 * gn + hv, i + 2 * gn);
    Some(match t {
        L::LinZ => mixer("in_proj.weight").rows(proj, 0, i),
        L::LinV => mixer("in_proj.weight").rows(proj, i, i),
        L::LinK => mixer("in_proj.weight").rows(proj, 2 * i, gn),
        L::LinQ => mixer("in_proj.weight").rows(proj, 2 * i + gn, gn),
        L::LinA => mixer("in_proj.weight").rows(proj, 2 * i + 2 * gn, hv),
        L::LinConvV => mixer("conv1d.weight").rows(conv, 0, i),
        L::LinConvK => mixer("conv1d.weight").rows(conv, i, gn),
        L::LinConvQ => mixer("conv1d.weight").rows(conv, i + gn, gn),
        L::LinConvBiasV => mixer("conv1d.bias").rows(conv, 0, i),
        L::LinConvBiasK => mixer("conv1d.bias").rows(conv, i, gn),
        L::LinConvBiasQ => mixer("conv1d.bias").rows(conv, i + gn, gn),
        L::LinALog => mixer("A_log"),
        L::LinDtBias => mixer("dt_bias"),
        L::LinSkip => mixer("D"),
        L::LinNorm => mixer("norm.weight"),
        _ => return None,
    })
}

/// Which layers are MoE under Qwen's `mlp_only_layers` / `decoder_sparse_step` rule:
/// layer `l` is sparse when it is not listed in `mlp_only_layers`, there are
/// experts, and `(l + 1) % decoder_sparse_step == 0`.
pub(crate) fn qwen_sparse_layers(cfg: &HfConfig, num_layers: usize, num_experts: usize) -> Result<Vec<bool>> {
    let dense = cfg.usize_list("mlp_only_layers")?;
    let step = cfg.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    Ok((0..num_layers).map(|l| !dense.contains(&l) && num_experts > 0 && step > 0 && (l + 1) % step == 0).collect())
}

/// `layer_types` of a hybrid as "linear attention?" flags, if the config
/// lists them: each `linear_attention` or `full_attention`, one per layer.
pub(crate) fn linear_layer_types(cfg: &HfConfig, n: usize) -> Result<Option<Vec<bool>>> {
    let Some(v) = cfg.get("layer_types") else { return Ok(None) };
    let list = v.as_array().ok_or_else(|| cfg.err(format!("`layer_types` must be a list, got {v}")))?;
    if list.len() != n {
        return Err(cfg.err(format!("`layer_types` lists {} layers, but num_hidden_layers is {n}", list.len())));
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("linear_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(cfg.err(format!(
                "`layer_types[{i}]` is {t}; this family has only \"linear_attention\" and \"full_attention\" layers"
            ))),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

/// `layer_types` as "slides?" flags, if the config lists them.
pub(crate) fn layer_types(cfg: &HfConfig, n: usize) -> Result<Option<Vec<bool>>> {
    let Some(v) = cfg.get("layer_types") else { return Ok(None) };
    let list = v.as_array().ok_or_else(|| cfg.err(format!("`layer_types` must be a list, got {v}")))?;
    if list.len() != n {
        return Err(cfg.err(format!("`layer_types` lists {} layers, but num_hidden_layers is {n}", list.len())));
    }
    list.iter()
        .map(|t| match t.as_str() {
            Some("sliding_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(Error::Unsupported(format!("{}: layer type {t} is not supported", cfg.path.display()))),
        })
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(text: &str) -> HfConfig {
        HfConfig::parse(Path::new("config.json"), text).unwrap()
    }

    /// Python's bare `Infinity`, `-Infinity` and `NaN` values read as the
    /// numbers Python's `json` makes of them (Nemotron-H's `time_step_limit`);
    /// inside strings and as keys they are left alone.
    #[test]
    fn python_constants_read_as_python_reads_them() {
        let c = cfg(r#"{"time_step_limit": [0.0, Infinity], "lo": -Infinity, "x":NaN, "s": "Infinity, NaN", "é": 1}"#);
        assert_eq!(c.raw["time_step_limit"][0].as_f64(), Some(0.0));
        assert_eq!(python_constant(&c.raw["time_step_limit"][1]), Some(f64::INFINITY));
        assert_eq!(c.opt_f64("lo").unwrap(), Some(f64::NEG_INFINITY));
        assert!(c.opt_f64("x").unwrap().unwrap().is_nan());
        assert_eq!(c.str("s"), Some("Infinity, NaN"));
        assert!(c.opt_f64("s").is_err());
        assert_eq!(c.opt_usize("é").unwrap(), Some(1));
        assert_eq!(c.opt_f64_list("time_step_limit").unwrap(), Some(vec![0.0, f64::INFINITY]));
        assert!(c.opt_f64_list("s").is_err());
    }

    /// JSON that is malformed apart from Python's constants is still refused.
    #[test]
    fn malformed_json_is_still_refused() {
        for text in [
            r#"{"a": Infinityx}"#,
            r#"{"a": Infinity Infinity}"#,
            r#"{"a": 1, Infinity: 2}"#,
            r#"{Infinity: 2}"#,
            r#"{"a": inf}"#,
            r#"{"a": [0.0, Infinity}"#,
            r#"{"a": "Infinity}"#,
            r#"{"a": +Infinity}"#,
        ] {
            let err = HfConfig::parse(Path::new("config.json"), text).err();
            assert!(err.is_some_and(|e| e.to_string().contains("not valid JSON")), "{text}");
        }
    }

    #[test]
    fn unknown_architecture_names_itself_and_the_supported_ones() {
        let c = cfg(r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}"#);
        let msg = lookup(&c).err().unwrap().to_string();
        assert!(msg.contains("LlamaForCausalLM") && msg.contains("MixtralForCausalLM"), "{msg}");
    }

    #[test]
    fn rope_both_spellings_agree() {
        let v4 = cfg(r#"{"rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}"#);
        let v5 = cfg(r#"{"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}"#);
        assert_eq!(v4.rope(8, 1.0).unwrap(), v5.rope(8, 1.0).unwrap());
        assert_eq!(v4.rope(8, 1.0).unwrap().theta, 5000.0);
    }

    #[test]
    fn unsupported_rope_type_is_refused() {
        let c = cfg(r#"{"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}"#);
        assert!(matches!(c.rope(8, 1e4), Err(Error::Unsupported(_))));
    }
}
