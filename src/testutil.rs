//! Test helpers: tiny random `.colibri` files built without any checkpoint.

use std::path::Path;

use crate::format::writer::{ToPlace, Writer, layout};
use crate::format::{FileMeta, SourceInfo};
use crate::model::config::*;
use crate::model::tensors::{Role, TensorId, tensor_plan};
use crate::quant::{self, DType};

/// A small MoE config with awkward sizes: every feature of the canonical
/// config that the forward pass branches on is switched on somewhere.
pub fn tiny_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 53,
        hidden_size: 22,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 6,
        max_seq_len: 64,
        norm: NormSpec { eps: 1e-5 },
        rope: RopeSpec { theta: 10000.0, rotary_dim: 6, scaling: RopeScaling::None },
        attention: AttentionSpec { qkv_bias: true, o_bias: false, qk_norm: QkNorm::PerHead, clip_qkv: None },
        moe: Some(MoeSpec {
            num_experts: 5,
            expert_ffn_dim: 10,
            router: RouterSpec { top_k: 2, score: RouterScore::Softmax, renormalize: true, scale: 1.0 },
            activation: Activation::Silu,
            shared_expert: Some(SharedExpertSpec { ffn_dim: 7, sigmoid_gate: true }),
        }),
        layers: vec![
            LayerSpec { sliding_window: None, ffn: FfnSpec::Moe },
            LayerSpec { sliding_window: Some(5), ffn: FfnSpec::Dense { ffn_dim: 9 } },
            LayerSpec { sliding_window: None, ffn: FfnSpec::Moe },
        ],
        tie_embeddings: false,
    }
}

/// Writes a `.colibri` file for `cfg` with deterministic pseudo-random weights.
pub fn write_random_model(path: &Path, cfg: &ModelConfig, dtype: DType, seed: u64) -> FileMeta {
    let plan = tensor_plan(cfg);
    let items: Vec<ToPlace> = plan
        .iter()
        .map(|p| ToPlace {
            name: p.id.to_string(),
            dtype: if p.role == Role::Matrix { dtype } else { DType::F32 },
            shape: p.shape.clone(),
            expert: match p.id {
                TensorId::Expert(l, e, _) => Some((l, e)),
                _ => None,
            },
        })
        .collect();
    let (tensors, experts) = layout(&items).unwrap();
    let meta = FileMeta {
        architecture: "TestForCausalLM".into(),
        config: cfg.clone(),
        weight_dtype: dtype,
        source: SourceInfo::default(),
        tensors,
        experts,
    };
    let mut w = Writer::create(path, &meta).unwrap();
    let mut s = seed.wrapping_mul(2862933555777941757).wrapping_add(3037000493);
    for (p, e) in plan.iter().zip(&meta.tensors) {
        let n: usize = p.shape.iter().product();
        let fan_in = *p.shape.last().unwrap() as f32;
        let is_norm = p.shape.len() == 1 && !e.name.contains(".b");
        let vals: Vec<f32> = (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let u = ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                if is_norm {
                    1.0 + 0.3 * u
                } else if p.id == TensorId::Embed {
                    u
                } else {
                    u * 2.0 / fan_in.sqrt()
                }
            })
            .collect();
        let mut bytes = vec![0u8; e.nbytes as usize];
        quant::encode(e.dtype, &vals, &mut bytes);
        w.begin(&e.name).unwrap();
        w.write(&bytes).unwrap();
        w.end();
    }
    w.finish().unwrap();
    meta
}
