//! Conversion recipes: which weight type each class of matrix is stored in.
//!
//! `colibri convert --dtype` takes a single type (every matrix in it), a
//! preset name from [`PRESETS`], or a spec of `class=type` pairs separated by
//! commas, with `default=type` for the classes not named
//! (`experts=q4_1,experts_down=q8_0,default=q8_0`). The classes are those of
//! [`TensorClass`]: `embed`, `lm_head`, `attn` (q and o), `attn_kv` (k and
//! v), `ffn`, `shared`, `experts` (routed gate and up), `experts_down`, and
//! `tied` (an embedding that is also the output head). Norms, biases and the
//! router are f32 whatever the recipe. A class the recipe leaves out keeps
//! the source's own type, but `tied`, which takes `lm_head`'s type (named or
//! default) unless named, and `attn_kv`, which takes `attn`'s the same way.
//!
//! Mixed recipes follow what quantisation studies of MoE models report: the
//! routed experts hold nearly all the bytes and tolerate 4 bits; attention,
//! shared experts, the output head and the embedding are a small share of
//! the bytes and are read by every token, so they get 6 or 8 bits (the K
//! mixes keep an untied output head at q6k: on a model whose vocabulary is
//! a large share of the weights, q8_0 there would cost more bits than
//! llama.cpp's Q4_K_M spends in all; a tied embedding, whose error enters at
//! both ends, gets q8_0); the experts' down projections are the most
//! sensitive of the expert matrices, so q4k-mix keeps them a step higher
//! (q5k). q5k-mix does not: with q6k's scale per 16 values their q6k cost
//! 0.17 bits per weight on the Qwen3-30B-A3B-width bench model for 4% lower
//! KL, and put the mix above llama.cpp Q5_K_M's size (docs/accuracy.md).
//! Attention is a third of what a token of Qwen3-30B-A3B reads, so q4k-mix
//! stores its q and o at q5k, and the small k and v, which every head of a
//! group reads, at q6k: 5% fewer bytes per token than q6k throughout, for
//! KL still below llama.cpp Q4_K_M's (q and o at q4k doubled the trained
//! demo model's KL).

use crate::canonical::tensors::TensorClass;
use crate::error::{Error, Result};
use crate::quant::DType;

/// The named recipes: (name, spec, what it is for).
pub const PRESETS: &[(&str, &str, &str)] = &[
    (
        "q4k-mix",
        "experts=q4k,experts_down=q5k,embed=q4k,lm_head=q6k,tied=q8_0,attn=q5k,attn_kv=q6k,default=q6k",
        "routed experts q4k with their down projections q5k, attention's q and o q5k, its k and v, \
         shared experts and the output head q6k, a tied embedding q8_0; 4.87 bits per weight on \
         Qwen3-30B-A3B's shapes, about llama.cpp Q4_K_M's size",
    ),
    (
        "q5k-mix",
        "experts=q5k,experts_down=q5k,embed=q5k,lm_head=q6k,tied=q8_0,default=q6k",
        "routed experts q5k (their down projections too), attention, shared experts and the \
         output head q6k, a tied embedding q8_0; 5.55 bits per weight on Qwen3-30B-A3B's shapes",
    ),
    (
        "q4_1-mix",
        "experts=q4_1,experts_down=q4_1,default=q8_0",
        "routed experts 4-bit (q4_1), everything else 8-bit (q8_0)",
    ),
    (
        "q4_1-mix-down8",
        "experts=q4_1,experts_down=q8_0,default=q8_0",
        "as q4_1-mix, with the experts' down projections at 8 bits",
    ),
];

/// A weight type per matrix class (`None`: the source's own).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recipe {
    /// How the user spelled it (a type, a preset or a spec).
    pub name: String,
    types: [Option<DType>; TensorClass::ALL.len()],
}

impl Recipe {
    /// Every matrix in `dtype`.
    pub fn uniform(dtype: DType) -> Recipe {
        Recipe { name: dtype.name().to_string(), types: [Some(dtype); TensorClass::ALL.len()] }
    }

    /// Parses a type name, a preset name or a `class=type,...` spec.
    pub fn parse(s: &str) -> Result<Recipe> {
        let s = s.trim();
        if let Some(d) = DType::parse(s) {
            return Ok(Recipe::uniform(d));
        }
        if let Some((name, spec, _)) = PRESETS.iter().find(|(n, _, _)| n.eq_ignore_ascii_case(s)) {
            let mut r = Recipe::parse_spec(spec)?;
            r.name = name.to_string();
            return Ok(r);
        }
        if s.contains('=') {
            return Recipe::parse_spec(s);
        }
        let types: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
        let presets: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
        Err(Error::InvalidInput(format!(
            "unknown dtype {s:?}: give a type ({}), a recipe ({}) or class=type pairs (classes: {})",
            types.join(", "),
            presets.join(", "),
            class_names()
        )))
    }

    fn parse_spec(spec: &str) -> Result<Recipe> {
        let mut types = [None; TensorClass::ALL.len()];
        let mut default = None;
        let mut seen = Vec::new();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (class, ty) = part
                .split_once('=')
                .ok_or_else(|| Error::InvalidInput(format!("recipe part {part:?} is not class=type")))?;
            let (class, ty) = (class.trim(), ty.trim());
            let d = DType::parse(ty).filter(|d| DType::ALL.contains(d)).ok_or_else(|| {
                let names: Vec<&str> = DType::ALL.iter().map(|d| d.name()).collect();
                Error::InvalidInput(format!("recipe part {part:?}: unknown type {ty:?} (types: {})", names.join(", ")))
            })?;
            if seen.contains(&class) {
                return Err(Error::InvalidInput(format!("recipe names {class:?} twice")));
            }
            seen.push(class);
            if class == "default" {
                default = Some(d);
                continue;
            }
            let i = TensorClass::ALL.iter().position(|c| c.name() == class).ok_or_else(|| {
                Error::InvalidInput(format!(
                    "recipe part {part:?}: unknown class {class:?} (classes: {}, default)",
                    class_names()
                ))
            })?;
            types[i] = Some(d);
        }
        if seen.is_empty() {
            return Err(Error::InvalidInput("empty recipe".into()));
        }
        // A tied embedding not named is the output head, and attention's k
        // and v not named are attention: their types, the default included.
        let follows = [(TensorClass::Tied, TensorClass::LmHead), (TensorClass::AttentionKv, TensorClass::Attention)];
        let named = follows.map(|(c, _)| types[class_index(c)].is_some());
        for t in &mut types {
            *t = t.or(default);
        }
        for ((class, leader), named) in follows.into_iter().zip(named) {
            if !named {
                types[class_index(class)] = types[class_index(leader)];
            }
        }
        Ok(Recipe { name: spec.to_string(), types })
    }

    /// The type of a class (`None`: keep the source's).
    pub fn dtype(&self, class: TensorClass) -> Option<DType> {
        self.types[class_index(class)]
    }

    /// The type the file records as its weight type: the routed experts'
    /// (they hold most of the bytes), else the first class given one.
    pub fn primary(&self) -> Option<DType> {
        self.dtype(TensorClass::ExpertGateUp).or_else(|| self.types.iter().flatten().next().copied())
    }

    /// True when every class has the same type.
    pub fn is_uniform(&self) -> bool {
        self.types.iter().all(|t| *t == self.types[0])
    }
}

fn class_index(class: TensorClass) -> usize {
    TensorClass::ALL.iter().position(|c| *c == class).expect("every class is in ALL")
}

fn class_names() -> String {
    TensorClass::ALL.iter().map(|c| c.name()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_presets_and_specs_parse() {
        let r = Recipe::parse("Q4_1").unwrap();
        assert!(r.is_uniform() && r.primary() == Some(DType::Q4_1));
        let r = Recipe::parse("q4_1-mix-down8").unwrap();
        assert_eq!(r.name, "q4_1-mix-down8");
        assert_eq!(r.dtype(TensorClass::ExpertGateUp), Some(DType::Q4_1));
        assert_eq!(r.dtype(TensorClass::ExpertDown), Some(DType::Q8_0));
        assert_eq!(r.dtype(TensorClass::Attention), Some(DType::Q8_0));
        assert_eq!(r.primary(), Some(DType::Q4_1));
        let r = Recipe::parse(" experts = q4_0 , attn=bf16").unwrap();
        assert_eq!(r.dtype(TensorClass::ExpertGateUp), Some(DType::Q4_0));
        assert_eq!(r.dtype(TensorClass::Attention), Some(DType::Bf16));
        assert_eq!(r.dtype(TensorClass::LmHead), None, "not named, no default: the source's own");
        assert_eq!(r.dtype(TensorClass::Tied), None, "the output head's");
        let r = Recipe::parse("experts=q4k,lm_head=q6k").unwrap();
        assert_eq!(r.dtype(TensorClass::Tied), Some(DType::Q6K), "a tied embedding is the output head");
        let r = Recipe::parse("experts=q4k,default=q5k").unwrap();
        assert_eq!(r.dtype(TensorClass::Tied), Some(DType::Q5K), "the output head's default");
        let r = Recipe::parse("experts=q4k,attn=q5k,default=q6k").unwrap();
        assert_eq!(r.dtype(TensorClass::AttentionKv), Some(DType::Q5K), "k and v are attention unless named");
        let r = Recipe::parse("attn=q4k,attn_kv=q8_0,default=q6k").unwrap();
        assert_eq!(
            (r.dtype(TensorClass::Attention), r.dtype(TensorClass::AttentionKv)),
            (Some(DType::Q4K), Some(DType::Q8_0))
        );
        let r = Recipe::parse("q4k-mix").unwrap();
        assert_eq!((r.dtype(TensorClass::LmHead), r.dtype(TensorClass::Tied)), (Some(DType::Q6K), Some(DType::Q8_0)));
        for (name, _, _) in PRESETS {
            assert!(Recipe::parse(name).is_ok(), "{name}");
        }
    }

    #[test]
    fn bad_recipes_say_what_is_wrong() {
        let msg = |s: &str| Recipe::parse(s).unwrap_err().to_string();
        assert!(msg("q3").contains("q4_1-mix"), "lists the presets");
        assert!(msg("experts=q9").contains("unknown type \"q9\""));
        assert!(msg("expert=q4_0").contains("unknown class \"expert\""));
        assert!(msg("experts=q4_0,experts=q8_0").contains("twice"));
        assert!(msg("experts").contains("unknown dtype"));
        assert!(msg("experts=q4_0x8").contains("unknown type"), "interleaved forms are not chosen by name");
        assert!(msg("experts=").contains("unknown type \"\""));
    }
}
