//! What a sequence keeps per layer between forward passes, derived from the
//! config: the shape of each layer's state and the bytes it takes, split into
//! the part that grows with every token and the part fixed per sequence.

use crate::canonical::config::{MixerSpec, ModelConfig, Pool};

/// Which positions a KV layer keeps rows for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// Every position of the sequence.
    Full,
    /// Attention reads only the last `w` positions: the cache keeps a
    /// sliding buffer of [`window_rows`] rows, fixed per sequence.
    Window(usize),
}

/// Default number of prompt tokens processed together in one prefill pass
/// (which also sizes sliding windows' caches): each pass reads every used
/// expert once, and with 512 tokens a top-8 of 64 experts gives each about
/// 64 tokens, four whole AMX tiles (OLMoE width, q8_0, 2 threads, 512-token
/// prompt: 399 -> 443 tok/s on AVX-VNNI and 514 -> 714 on AMX tiles, going
/// from 128-token passes to 512).
pub const DEFAULT_CHUNK: usize = 512;

/// Positions a sliding-window cache keeps beyond its window, so a sequence
/// can go back that many tokens (speculative decoding's rejected drafts).
pub const ROLLBACK: usize = 32;

/// Rows of a sliding-window cache of window `w` fed up to `chunk` tokens a
/// pass: the `w − 1 + ROLLBACK` rows kept when it slides, room for a pass,
/// and as many again, so it slides once per `w + ROLLBACK` decoded tokens,
/// not at every one.
pub fn window_rows(w: usize, chunk: usize) -> usize {
    2 * (w + ROLLBACK) + chunk
}

/// The state one layer keeps for a sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerState {
    /// Keys and values of every kv head (grouped-query attention): each
    /// position adds `heads · (k_width + v_width)` values.
    Kv {
        /// Hkv: kv heads.
        heads: usize,
        /// Key values per head and position.
        k_width: usize,
        /// Value values per head and position.
        v_width: usize,
        /// Which positions are kept.
        rows: Rows,
    },
    /// Multi-head latent attention: one row per position shared by every
    /// head, the compressed key/value latent followed by the rotated key;
    /// keys and values are recovered from it, so nothing else is stored.
    Latent {
        /// Values per position: latent rank plus rotated-key width.
        width: usize,
        /// Which positions are kept.
        rows: Rows,
    },
    /// Sparse attention with its own lightning indexer: MLA's latent row
    /// and the indexer's key, both one row per position and both kept for
    /// every position (the indexer scores every earlier key). A sparse
    /// layer that reuses another's selection keeps only a [`LayerState::Latent`].
    Indexed {
        /// Latent values per position (latent rank plus rotated-key width).
        width: usize,
        /// Indexer key values per position (the index head width).
        key_width: usize,
    },
    /// Block-sparse grouped-query attention with its block indexer
    /// (MiniMax-M3): the keys and values of every kv head and the index key,
    /// all kept for every position (the indexer scores every earlier block).
    BlockIndexed {
        /// Hkv: kv heads.
        heads: usize,
        /// Dh: key (and value) values per head and position.
        head_dim: usize,
        /// Index key values per position (the index head width).
        key_width: usize,
    },
    /// DeepSeek-V4's pooled attention, four pieces, all float32: the
    /// sliding window's `window` key/value rows of `width` values (fixed);
    /// the pooler's unfinished block, `rate` rows of projected values and
    /// gates, plus on light layers the previous block's overlap half
    /// (fixed); the pooled entries, one of `width` values per `rate`
    /// tokens; on light layers the indexer's own unfinished block, overlap
    /// and pooled keys of `index_width` values.
    Pooled {
        /// Rows of the sliding window.
        window: usize,
        /// Dh: values per key/value row and per pooled entry.
        width: usize,
        /// Tokens per entry (0: a window-only layer, which pools nothing).
        rate: usize,
        /// Overlapping entries (a light layer): each block's projection is
        /// two rows wide, and the previous block's half is kept.
        overlap: bool,
        /// Di: values per index key (0 without an indexer).
        index_width: usize,
    },
    /// Linear attention: a fixed float32 state whatever the sequence's
    /// length, the last `kernel − 1` inputs of the causal convolution and
    /// one `[Dk, Dv]` matrix per value head.
    Recurrent {
        /// Convolution inputs kept: (kernel − 1) · channels.
        conv: usize,
        /// Recurrent-state values: Hv · Dk · Dv.
        matrix: usize,
    },
}

/// Bytes of one recurrent-state value: linear attention keeps its state in
/// float32 whatever the KV cache's element type, as transformers does.
pub const RECURRENT_VALUE_BYTES: usize = 4;

impl LayerState {
    /// Cached values one position takes (KV kinds; 0 for a recurrent state).
    fn values_per_row(&self) -> usize {
        match *self {
            LayerState::Kv { heads, k_width, v_width, .. } => heads * (k_width + v_width),
            LayerState::Latent { width, .. } => width,
            LayerState::Indexed { width, key_width } => width + key_width,
            LayerState::BlockIndexed { heads, head_dim, key_width } => 2 * heads * head_dim + key_width,
            LayerState::Recurrent { .. } | LayerState::Pooled { .. } => 0,
        }
    }

    /// Bytes each new position adds with `elem_bytes` per cached KV value
    /// (a pooled layer's entries are float32 and come one per `rate`
    /// tokens: their share per token, rounded up).
    pub fn bytes_per_token(&self, elem_bytes: usize) -> usize {
        match *self {
            LayerState::Pooled { width, rate, index_width, .. } if rate > 0 => {
                ((width + index_width) * RECURRENT_VALUE_BYTES).div_ceil(rate)
            }
            _ => self.values_per_token() * elem_bytes,
        }
    }

    /// A pooled layer's pieces with their bytes per sequence (fixed) and
    /// per token, for `colibri info` and the stats: the window, the
    /// unfinished block (with the overlap), the entries, the index keys'
    /// block and the index keys.
    pub fn pooled_pieces(&self) -> Vec<(&'static str, usize, usize)> {
        let LayerState::Pooled { window, width, rate, overlap, index_width } = *self else { return Vec::new() };
        let b = RECURRENT_VALUE_BYTES;
        let m = if overlap { 2 } else { 1 };
        let mut out = vec![("window", window * width * b, 0)];
        if rate > 0 {
            let block = 2 * rate * m * width + if overlap { 2 * rate * width } else { 0 };
            out.push(("pool_block", block * b, 0));
            out.push(("pool_entries", 0, (width * b).div_ceil(rate)));
        }
        if index_width > 0 {
            out.push(("index_block", (4 * rate * index_width + 2 * rate * index_width) * b, 0));
            out.push(("index_keys", 0, (index_width * b).div_ceil(rate)));
        }
        out
    }

    /// Cached values each new position adds (0 for a sliding window's
    /// cache and a recurrent state, which are fixed in size).
    pub fn values_per_token(&self) -> usize {
        match *self {
            LayerState::Kv { rows: Rows::Full, .. }
            | LayerState::Latent { rows: Rows::Full, .. }
            | LayerState::Indexed { .. }
            | LayerState::BlockIndexed { .. } => self.values_per_row(),
            _ => 0,
        }
    }

    /// Bytes kept per sequence whatever its length: a recurrent state, or a
    /// sliding window's rows for passes of up to `chunk` tokens with
    /// `elem_bytes` per cached value (none for a cache of every position).
    pub fn bytes_per_sequence(&self, elem_bytes: usize, chunk: usize) -> usize {
        match *self {
            LayerState::Kv { rows: Rows::Window(w), .. } | LayerState::Latent { rows: Rows::Window(w), .. } => {
                window_rows(w, chunk) * self.values_per_row() * elem_bytes
            }
            LayerState::Kv { .. }
            | LayerState::Latent { .. }
            | LayerState::Indexed { .. }
            | LayerState::BlockIndexed { .. } => 0,
            LayerState::Recurrent { conv, matrix } => (conv + matrix) * RECURRENT_VALUE_BYTES,
            LayerState::Pooled { .. } => self.pooled_pieces().iter().map(|p| p.1).sum(),
        }
    }
}

/// A model's state memory per sequence for one cache element size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateLayout {
    /// Bytes every token of a sequence adds, over all layers.
    pub bytes_per_token: usize,
    /// Bytes a sequence takes whatever its length, over all layers.
    pub bytes_per_sequence: usize,
}

impl StateLayout {
    /// The layout of `cfg`'s layer states with `elem_bytes` bytes per cached
    /// KV value (recurrent states are float32 whatever it is), for passes of
    /// up to `chunk` tokens (which sizes sliding windows' caches).
    pub fn new(cfg: &ModelConfig, elem_bytes: usize, chunk: usize) -> StateLayout {
        let states = cfg.layer_states();
        StateLayout {
            bytes_per_token: states.iter().map(|s| s.bytes_per_token(elem_bytes)).sum::<usize>(),
            bytes_per_sequence: states.iter().map(|s| s.bytes_per_sequence(elem_bytes, chunk)).sum::<usize>(),
        }
    }

    /// Bytes of one sequence of `tokens` tokens (at most: a sequence shorter
    /// than a sliding window's cache allocates only its own length of it).
    pub fn bytes_for(&self, tokens: usize) -> usize {
        self.bytes_per_sequence + tokens * self.bytes_per_token
    }
}

impl ModelConfig {
    /// The state layer `l` keeps per sequence.
    pub fn layer_state(&self, l: usize) -> LayerState {
        match self.layers[l].mixer {
            MixerSpec::Attention { window } => {
                let rows = window.map_or(Rows::Full, Rows::Window);
                match self.mla() {
                    Some(m) => LayerState::Latent { width: m.kv_lora_rank + m.qk_rope_dim, rows },
                    None => {
                        let shape = self.head_shape(l);
                        LayerState::Kv { heads: shape.kv_heads, k_width: shape.head_dim, v_width: shape.head_dim, rows }
                    }
                }
            }
            MixerSpec::Sparse { .. } if self.mla().is_none() => {
                let b = self.attention.block_index.expect("validated: a GQA sparse layer has a block indexer");
                LayerState::BlockIndexed { heads: self.num_kv_heads, head_dim: self.head_dim, key_width: b.head_dim }
            }
            MixerSpec::Sparse { shared } => {
                let m = self.mla().expect("validated: a sparse layer is latent attention");
                let width = m.kv_lora_rank + m.qk_rope_dim;
                match m.indexer {
                    Some(ix) if !shared => LayerState::Indexed { width, key_width: ix.head_dim },
                    _ => LayerState::Latent { width, rows: Rows::Full },
                }
            }
            MixerSpec::Pooled { pool } => {
                let p = self.pooled().expect("validated: a pooled layer has a pooled spec");
                let (rate, index_width) = match pool {
                    Pool::Window => (0, 0),
                    Pool::Heavy => (p.heavy_rate, 0),
                    Pool::Light => (p.light_rate, p.indexer.head_dim),
                };
                LayerState::Pooled {
                    window: p.window,
                    width: self.head_dim,
                    rate,
                    overlap: pool == Pool::Light,
                    index_width,
                }
            }
            MixerSpec::Linear => {
                let lin = self.linear.expect("validated: a linear layer has a linear spec");
                LayerState::Recurrent {
                    conv: (lin.conv_kernel - 1) * lin.conv_dim(),
                    matrix: lin.v_heads * lin.k_head_dim * lin.v_head_dim,
                }
            }
        }
    }

    /// Every layer's state, in order.
    pub fn layer_states(&self) -> Vec<LayerState> {
        (0..self.num_layers()).map(|l| self.layer_state(l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::canonical::config::{AttentionKind, AttentionSpec, FfnSpec, LayerSpec, MlaSpec};

    fn layers(windows: &[Option<usize>]) -> Vec<LayerSpec> {
        windows
            .iter()
            .map(|&window| LayerSpec { mixer: MixerSpec::Attention { window }, ffn: FfnSpec::Dense { ffn_dim: 64 } })
            .collect()
    }

    /// Grouped-query attention: keys and values of every kv head, per layer.
    #[test]
    fn gqa_layout_counts_keys_and_values_of_every_kv_head() {
        let cfg = ModelConfig {
            num_heads: 8,
            num_kv_heads: 2,
            head_dim: 16,
            layers: layers(&[None; 3]),
            ..Default::default()
        };
        assert_eq!(cfg.layer_state(1), LayerState::Kv { heads: 2, k_width: 16, v_width: 16, rows: Rows::Full });
        // 3 layers · 2 heads · (16 + 16) values · 4 bytes.
        assert_eq!(
            StateLayout::new(&cfg, 4, 512),
            StateLayout { bytes_per_token: 3 * 2 * 32 * 4, bytes_per_sequence: 0 }
        );
        // f16: 3 · 2 · 32 · 2.
        assert_eq!(StateLayout::new(&cfg, 2, 512).bytes_per_token, 384);
        assert_eq!(StateLayout::new(&cfg, 2, 512).bytes_for(10), 3840);
    }

    /// MLA: one latent row (rank + rotated key) per layer and position.
    #[test]
    fn mla_layout_counts_one_latent_row() {
        let mla = MlaSpec {
            q_lora_rank: None,
            kv_lora_rank: 32,
            qk_nope_dim: 12,
            qk_rope_dim: 4,
            v_head_dim: 10,
            latent_eps: 1e-6,
            indexer: None,
        };
        let cfg = ModelConfig {
            num_heads: 4,
            num_kv_heads: 4,
            head_dim: 16,
            attention: AttentionSpec { kind: AttentionKind::Mla(mla), ..Default::default() },
            layers: layers(&[None; 2]),
            ..Default::default()
        };
        assert_eq!(cfg.layer_state(0), LayerState::Latent { width: 36, rows: Rows::Full });
        // 2 layers · (32 + 4) values · 2 bytes.
        assert_eq!(StateLayout::new(&cfg, 2, 512), StateLayout { bytes_per_token: 144, bytes_per_sequence: 0 });
    }

    /// Sparse attention: a layer with its own indexer keeps the latent row
    /// and the index key per position; one that reuses the selection of the
    /// layer before it keeps only the latent.
    #[test]
    fn sparse_layers_count_their_index_keys() {
        use crate::canonical::config::IndexerSpec;
        let indexer =
            IndexerSpec { heads: 3, head_dim: 10, top_k: 4, rope_dim: 4, rope_interleaved: false, key_norm_eps: 1e-6 };
        let mla = MlaSpec {
            q_lora_rank: Some(8),
            kv_lora_rank: 32,
            qk_nope_dim: 12,
            qk_rope_dim: 4,
            v_head_dim: 10,
            latent_eps: 1e-6,
            indexer: Some(indexer),
        };
        let mut ls = layers(&[None; 3]);
        ls[0].mixer = MixerSpec::Sparse { shared: false };
        ls[1].mixer = MixerSpec::Sparse { shared: true };
        ls[2].mixer = MixerSpec::Sparse { shared: false };
        let cfg = ModelConfig {
            num_heads: 4,
            num_kv_heads: 4,
            head_dim: 16,
            rope: crate::canonical::config::RopeSpec { rotary_dim: 4, ..ModelConfig::default().rope },
            attention: AttentionSpec { kind: AttentionKind::Mla(mla), ..Default::default() },
            layers: ls,
            ..Default::default()
        };
        cfg.validate().unwrap();
        assert_eq!(cfg.layer_state(0), LayerState::Indexed { width: 36, key_width: 10 });
        assert_eq!(cfg.layer_state(1), LayerState::Latent { width: 36, rows: Rows::Full });
        // (36 + 10) + 36 + (36 + 10) values per token, 2 bytes each.
        assert_eq!(StateLayout::new(&cfg, 2, 512), StateLayout { bytes_per_token: 128 * 2, bytes_per_sequence: 0 });
    }

    /// Block-sparse attention: keys and values of every kv head plus the
    /// index key per position and layer; full-attention layers beside them
    /// keep keys and values only.
    #[test]
    fn block_sparse_layers_count_their_index_keys() {
        use crate::canonical::config::BlockIndexSpec;
        let mut ls = layers(&[None; 3]);
        ls[1].mixer = MixerSpec::Sparse { shared: false };
        let block_index = Some(BlockIndexSpec { heads: 2, head_dim: 10, block: 4, top_blocks: 3, local_blocks: 1 });
        let cfg = ModelConfig {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            rope: crate::canonical::config::RopeSpec { rotary_dim: 4, ..ModelConfig::default().rope },
            attention: AttentionSpec { block_index, ..Default::default() },
            layers: ls,
            ..Default::default()
        };
        cfg.validate().unwrap();
        assert_eq!(cfg.layer_state(1), LayerState::BlockIndexed { heads: 2, head_dim: 8, key_width: 10 });
        // 3 layers · 2 heads · (8 + 8), plus 10 index values on layer 1; 2 bytes each.
        assert_eq!(
            StateLayout::new(&cfg, 2, 512),
            StateLayout { bytes_per_token: (3 * 32 + 10) * 2, bytes_per_sequence: 0 }
        );
    }

    /// A hybrid model: attention layers grow per token, linear-attention
    /// layers keep a fixed float32 state whatever the cache's element type.
    #[test]
    fn linear_layers_count_per_sequence_in_f32() {
        use crate::canonical::config::{LinearKind, LinearSpec};
        let mut ls = layers(&[None; 4]);
        ls[0].mixer = MixerSpec::Linear;
        ls[2].mixer = MixerSpec::Linear;
        let cfg = ModelConfig {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            linear: Some(LinearSpec {
                kind: LinearKind::GatedDeltaNet,
                k_heads: 2,
                v_heads: 4,
                k_head_dim: 6,
                v_head_dim: 5,
                conv_kernel: 4,
            }),
            layers: ls,
            ..Default::default()
        };
        // conv: 3 · (2·12 + 20) = 132 values; matrices 4 · 6 · 5 = 120.
        assert_eq!(cfg.layer_state(0), LayerState::Recurrent { conv: 132, matrix: 120 });
        // Per token: 2 attention layers · 2 heads · 16 values; per sequence 2 · 252 f32 values.
        for elem in [2, 4] {
            let want = StateLayout { bytes_per_token: 2 * 2 * 16 * elem, bytes_per_sequence: 2 * 252 * 4 };
            assert_eq!(StateLayout::new(&cfg, elem, 512), want);
        }
    }

    /// A Mamba2 layer keeps the convolution's last inputs over x, B and C
    /// and one `[N, P]` state per head, float32; a layer without FFN changes
    /// nothing of it.
    #[test]
    fn mamba2_layers_count_per_sequence_in_f32() {
        use crate::canonical::config::{LinearKind, LinearSpec};
        let mut ls = layers(&[None; 3]);
        ls[0].mixer = MixerSpec::Linear;
        ls[0].ffn = FfnSpec::None;
        let cfg = ModelConfig {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            linear: Some(LinearSpec {
                kind: LinearKind::Mamba2 { dt_min: 0.0 },
                k_heads: 2,
                v_heads: 6,
                k_head_dim: 16,
                v_head_dim: 8,
                conv_kernel: 4,
            }),
            layers: ls,
            ..Default::default()
        };
        // conv: 3 · (6·8 + 2·2·16) = 336 values; states 6 · 16 · 8 = 768.
        assert_eq!(cfg.layer_state(0), LayerState::Recurrent { conv: 336, matrix: 768 });
        let want = StateLayout { bytes_per_token: 2 * 2 * 16 * 2, bytes_per_sequence: (336 + 768) * 4 };
        assert_eq!(StateLayout::new(&cfg, 2, 512), want);
    }

    /// DeepSeek-V4's pooled layers: the window, the unfinished blocks and
    /// the overlap are fixed per sequence; the entries and index keys come
    /// one per `rate` tokens, float32 whatever the cache's type.
    #[test]
    fn pooled_layers_count_their_pieces() {
        let cfg = crate::synth::pooled_config();
        cfg.validate().unwrap();
        // Layers: heavy (8), light (4, index keys of 10), window only, light.
        let heavy = cfg.layer_state(0);
        assert_eq!(heavy, LayerState::Pooled { window: 6, width: 16, rate: 8, overlap: false, index_width: 0 });
        assert_eq!(heavy.bytes_per_token(2), 16 * 4 / 8);
        let light = cfg.layer_state(1);
        // Entries 16 · 4 / 4 plus index keys 10 · 4 / 4.
        assert_eq!(light.bytes_per_token(2), 16 + 10);
        let pieces: Vec<_> = light.pooled_pieces().iter().map(|p| p.0).collect();
        assert_eq!(pieces, ["window", "pool_block", "pool_entries", "index_block", "index_keys"]);
        // window 6·16, blocks 2·4·32 + overlap 2·4·16, index 6·4·10; f32.
        assert_eq!(light.bytes_per_sequence(2, 512), (6 * 16 + 2 * 4 * 32 + 2 * 4 * 16 + 6 * 4 * 10) * 4);
        let window = cfg.layer_state(2);
        assert_eq!((window.bytes_per_token(4), window.bytes_per_sequence(4, 512)), (0, 6 * 16 * 4));
        let layout = StateLayout::new(&cfg, 2, 512);
        assert_eq!(layout.bytes_per_token, 8 + 2 * 26);
    }

    /// A sliding-window layer keeps a fixed buffer: its window, the rollback
    /// reach and a pass, twice; it counts per sequence, not per token.
    #[test]
    fn sliding_window_layers_count_per_sequence() {
        let cfg = ModelConfig {
            num_heads: 4,
            num_kv_heads: 1,
            head_dim: 8,
            layers: layers(&[Some(5), None, Some(5), None]),
            ..Default::default()
        };
        assert_eq!(cfg.layer_state(0), LayerState::Kv { heads: 1, k_width: 8, v_width: 8, rows: Rows::Window(5) });
        assert_eq!(cfg.layer_state(1), LayerState::Kv { heads: 1, k_width: 8, v_width: 8, rows: Rows::Full });
        // 2 full layers · 1 head · (8 + 8) values · 4 bytes per token; 2 windowed
        // layers of (2 · (5 + 32) + 7) rows of 16 values, 4 bytes each.
        let rows = 2 * (5 + ROLLBACK) + 7;
        assert_eq!(window_rows(5, 7), rows);
        let want = StateLayout { bytes_per_token: 2 * 16 * 4, bytes_per_sequence: 2 * rows * 16 * 4 };
        assert_eq!(StateLayout::new(&cfg, 4, 7), want);
    }
}
