//! Per-conversation state: the KV cache and every activation buffer, sized
//! once at creation so the forward pass never allocates.

use crate::kernels::BlockQ8;
use crate::model::Model;
use crate::model::blocks::moe::MoeScratch;
use crate::model::config::FfnSpec;

/// Default number of prompt tokens processed together in one prefill pass.
pub const DEFAULT_CHUNK: usize = 128;

/// KV cache plus workspace for one sequence.
pub struct Session {
    /// Longest sequence this session holds (KV cache rows).
    pub max_seq: usize,
    /// C: most tokens one forward chunk processes.
    pub chunk: usize,
    /// Tokens already in the cache (the next token's position).
    pub pos: usize,
    /// [L, S, Hkv·Dh] keys (after norm and RoPE).
    pub k_cache: Vec<f32>,
    /// [L, S, Hkv·Dh] values.
    pub v_cache: Vec<f32>,
    /// [C, D] residual stream.
    pub x: Vec<f32>,
    /// [C, D] normed residual.
    pub xn: Vec<f32>,
    /// [C, H·Dh] queries.
    pub q: Vec<f32>,
    /// [C, Hkv·Dh] keys of this chunk.
    pub k: Vec<f32>,
    /// [C, Hkv·Dh] values of this chunk.
    pub v: Vec<f32>,
    /// [C, H·Dh] attention output.
    pub att: Vec<f32>,
    /// [C, D] block output before the residual add.
    pub proj: Vec<f32>,
    /// [C, D] shared expert output.
    pub shared: Vec<f32>,
    /// [C, Fmax] gate scratch for dense and shared MLPs.
    pub g: Vec<f32>,
    /// [C, Fmax] up scratch.
    pub u: Vec<f32>,
    /// Some matrix is block-quantised, so activations are quantised too.
    pub quantize: bool,
    /// [C, max(D, H·Dh)/32] quantised copy of the current matmul input.
    pub xq: Vec<BlockQ8>,
    /// [C, Fmax/32] quantised MLP hidden activations.
    pub hq: Vec<BlockQ8>,
    /// [C, R/2] RoPE cosines of this chunk's positions.
    pub cos: Vec<f32>,
    /// [C, R/2] RoPE sines.
    pub sin: Vec<f32>,
    /// MoE scratch.
    pub moe: MoeScratch,
    /// [V] logits of the last token processed.
    pub logits: Vec<f32>,
}

impl Session {
    /// Allocates a session for sequences up to `max_seq` tokens (capped at the
    /// model's context), processing at most `chunk` tokens per pass.
    pub fn new(model: &Model, max_seq: usize, chunk: usize) -> Session {
        let c = &model.config;
        let max_seq = max_seq.clamp(1, c.max_seq_len);
        let chunk = chunk.clamp(1, max_seq);
        let (d, l, kv) = (c.hidden_size, c.num_layers(), c.kv_dim());
        let mut fmax = 1;
        for layer in &c.layers {
            if let FfnSpec::Dense { ffn_dim } = layer.ffn {
                fmax = fmax.max(ffn_dim);
            }
        }
        let (e, k, fe) = match &c.moe {
            Some(m) => {
                if let Some(s) = &m.shared_expert {
                    fmax = fmax.max(s.ffn_dim);
                }
                (m.num_experts, m.router.top_k, m.expert_ffn_dim)
            }
            None => (1, 1, 1),
        };
        let half = c.rope.rotary_dim / 2;
        Session {
            max_seq,
            chunk,
            pos: 0,
            k_cache: vec![0.0; l * max_seq * kv],
            v_cache: vec![0.0; l * max_seq * kv],
            x: vec![0.0; chunk * d],
            xn: vec![0.0; chunk * d],
            q: vec![0.0; chunk * c.q_dim()],
            k: vec![0.0; chunk * kv],
            v: vec![0.0; chunk * kv],
            att: vec![0.0; chunk * c.q_dim()],
            proj: vec![0.0; chunk * d],
            shared: vec![0.0; chunk * d],
            g: vec![0.0; chunk * fmax],
            u: vec![0.0; chunk * fmax],
            quantize: model.has_block_weights(),
            xq: vec![BlockQ8::default(); chunk * d.max(c.q_dim()) / 32],
            hq: vec![BlockQ8::default(); chunk * fmax / 32],
            cos: vec![0.0; chunk * half],
            sin: vec![0.0; chunk * half],
            moe: MoeScratch::new(chunk, e, k, d, fe),
            logits: vec![0.0; c.vocab_size],
        }
    }

    /// Forgets the sequence (keeps the buffers).
    pub fn reset(&mut self) {
        self.pos = 0;
    }
}
