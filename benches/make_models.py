#!/usr/bin/env python3
"""Random-weight MoE checkpoints of real model widths, for benchmarking.

For each shape this writes, under ``benches/.cache/<shape>-l<layers>/``:

- ``hf/``: a Hugging Face checkpoint folder (``config.json`` spelled as on the
  Hub, ``model.safetensors`` with the Hub's tensor names) in f16, which
  ``colibri convert`` reads;
- ``gguf/model-<TYPE>.gguf``: the same values as GGUF files for llama.cpp
  (F16 is bit-identical to the checkpoint; Q8_0 / Q4_0 are quantised from it by
  the ``gguf`` package's own quantiser).

Nothing here needs torch or transformers: tensors are generated with NumPy one
at a time and streamed to disk, so memory stays at a few hundred MB whatever
the model size. Every tensor is seeded by its name alone, so a 1-layer model
is exactly the first layer of the 4-layer one.

Weights are scaled like a fresh initialisation so activations stay in a sane
range: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights ~ 1 +
N(0, 0.1^2), the router at twice the matrix scale so routing decisions are not
near-ties.

Usage::

    python benches/make_models.py                      # both shapes, 4 layers, F16 + Q8_0 + Q4_0
    python benches/make_models.py --shapes olmoe --layers 1 --gguf-types F16
    python benches/make_models.py --sizes               # print sizes, write nothing
    python benches/make_models.py --shapes deepseek_v2_lite,gpt_oss_20b   # the MLA and GPT-OSS shapes
    python benches/make_models.py --shapes gpt_oss_20b --gguf-types MXFP4  # experts MXFP4, rest Q4_0
    python benches/make_models.py --shapes qwen3moe --mtp --base benches/.cache/qwen3moe-l4/hf
    python benches/make_models.py --shapes nemotron3_nano --layers 7 --gguf-types Q8_0  # blocks MEMEM*E

``--mtp`` adds one multi-token-prediction layer in Qwen3-Next's layout (``mtp.*``
tensors, ``mtp_num_hidden_layers: 1``) and writes ``<shape>-l<layers>-mtp/hf/`` as
two shards: the model's own tensors (the same values as without ``--mtp``,
hard-linked from ``--base`` when given) and the layer's. No GGUF: llama.cpp
does not run these layers for the family.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

CACHE = Path(__file__).resolve().parent / ".cache"


@dataclass(frozen=True)
class Shape:
    """Widths of one real model family (everything but the layer count)."""

    name: str
    hf_class: str
    model_type: str
    gguf_arch: str
    hidden: int
    experts: int
    top_k: int
    expert_ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: str  # "full" (OLMoE: over the whole projection) or "per_head" (Qwen3)
    norm_topk_prob: bool
    rope_theta: float
    rms_eps: float
    max_pos: int
    # DeepSeek-V2 (MLA, shared experts, leading dense layers); 0 elsewhere.
    shared_experts: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # GPT-OSS: sliding window of the even layers; 0 elsewhere.
    sliding_window: int = 0
    # Qwen1.5-MoE and Qwen3.5/3.6-MoE: the shared expert's width (gated by sigmoid(w·x));
    # Nemotron-H: the ungated shared expert's; 0 elsewhere.
    shared_ffn: int = 0
    # Qwen3.5/3.6-MoE (Gated DeltaNet hybrids); 0 elsewhere. Every
    # `full_every`-th layer is full attention, the others linear attention.
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    full_every: int = 0
    partial_rotary: float = 1.0
    # The released model's depth, for state-memory figures at full size (0: not used).
    hub_layers: int = 0
    # DeepSeek-V3-style MLA with a low-rank query path (GLM-4.7-Flash, DeepSeek-V3.2):
    # the query latent's width; 0: one q_proj (DeepSeek-V2-Lite).
    q_lora_rank: int = 0
    # Sigmoid routing with a selection-only e_score_correction_bias (GLM-4.7-Flash,
    # MiniMax-M2, DeepSeek-V3.2), the chosen weights times `routed_scale`.
    sigmoid_router: bool = False
    routed_scale: float = 1.0
    # DeepSeek-V3.2's lightning indexer (DSA); 0 heads: none.
    index_heads: int = 0
    index_dim: int = 0
    index_topk: int = 0
    # Nemotron-H / Nemotron 3 (`nemotron_h`): one block per Hub layer, as the
    # Hub's `hybrid_override_pattern` at full depth spells them (M Mamba2,
    # * attention without RoPE, E MoE of ungated relu2 experts plus one shared
    # expert of `shared_ffn`); a model of N layers is the first N blocks.
    # Mamba2: `mamba_heads` heads of `mamba_head_dim`, B and C in
    # `mamba_groups` groups of `ssm_state`, the convolution `conv_kernel`
    # wide. "" / 0 elsewhere.
    pattern: str = ""
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    ssm_state: int = 0

    def layer_types(self, layers: int) -> list[str]:
        """Qwen3.5's `layer_types`: three linear-attention layers to one full."""
        return [
            "full_attention" if (i + 1) % self.full_every == 0 else "linear_attention" for i in range(layers)
        ]

    def blocks(self, layers: int) -> str:
        """Nemotron-H's first `layers` blocks, one character each (M, *, E)."""
        if layers > len(self.pattern):
            raise ValueError(f"{self.name} has {len(self.pattern)} blocks, not {layers}")
        return self.pattern[:layers]

    def mixers(self, layers: int) -> list[str]:
        """The kind of each token mixer in order, "full_attention" or
        "linear_attention": the layers that hold a sequence's state
        (Nemotron-H's MoE blocks hold none)."""
        if self.pattern:
            return [
                "full_attention" if c == "*" else "linear_attention" for c in self.blocks(layers) if c in "M*"
            ]
        if self.full_every:
            return self.layer_types(layers)
        return ["full_attention"] * layers

    def hf_config(self, layers: int) -> dict:
        """config.json as the Hub's checkpoint spells it, with `layers` layers."""
        if self.model_type == "nemotron_h":
            return self._nemotron_h_config(layers)
        if self.model_type == "deepseek_v2":
            return self._deepseek_v2_config(layers)
        if self.model_type in ("glm4_moe_lite", "deepseek_v32"):
            return self._deepseek_v3_config(layers)
        if self.model_type == "minimax_m2":
            return self._minimax_m2_config(layers)
        if self.model_type == "deepseek_v4":
            return self._deepseek_v4_config(layers)
        if self.model_type == "gpt_oss":
            return self._gpt_oss_config(layers)
        if self.model_type == "qwen3_5_moe_text":
            return self._qwen3_5_moe_config(layers)
        common = {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "num_hidden_layers": layers,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_pos,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "use_cache": True,
            "output_router_logits": False,
            "initializer_range": 0.02,
        }
        if self.model_type == "olmoe":
            # OLMoE-1B-7B-0924: the expert width is `intermediate_size`.
            return {
                **common,
                "intermediate_size": self.expert_ffn,
                "clip_qkv": None,
                "router_aux_loss_coef": 0.01,
                "pad_token_id": 1,
                "eos_token_id": 50279,
                "bos_token_id": None,
            }
        if self.model_type == "qwen2_moe":
            # Qwen1.5-MoE-A2.7B: biased q/k/v, no q/k norm, one gated shared expert.
            return {
                **common,
                "attention_bias": True,
                "intermediate_size": self.shared_ffn,
                "moe_intermediate_size": self.expert_ffn,
                "shared_expert_intermediate_size": self.shared_ffn,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "sliding_window": None,
                "use_sliding_window": False,
                "max_window_layers": 21,
                "router_aux_loss_coef": 0.001,
                "bos_token_id": 151643,
                "eos_token_id": 151643,
            }
        # Qwen3-30B-A3B: `intermediate_size` is the (unused) dense width.
        return {
            **common,
            "head_dim": self.head_dim,
            "intermediate_size": 6144,
            "moe_intermediate_size": self.expert_ffn,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": 48,
            "router_aux_loss_coef": 0.001,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
        }

    def _deepseek_v2_config(self, layers: int) -> dict:
        # deepseek-ai/DeepSeek-V2-Lite's config.json, less its YaRN rope
        # scaling (not needed at the benchmark's lengths) and the auto_map.
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "aux_loss_alpha": 0.001,
            "bos_token_id": 100000,
            "eos_token_id": 100001,
            "first_k_dense_replace": self.dense_layers,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.dense_ffn,
            "kv_lora_rank": self.kv_lora_rank,
            "max_position_embeddings": self.max_pos,
            "moe_intermediate_size": self.expert_ffn,
            "moe_layer_freq": 1,
            "n_group": 1,
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "norm_topk_prob": self.norm_topk_prob,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "pretraining_tp": 1,
            "q_lora_rank": None,
            "qk_nope_head_dim": self.qk_nope_dim,
            "qk_rope_head_dim": self.qk_rope_dim,
            "rms_norm_eps": self.rms_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "seq_aux": True,
            "tie_word_embeddings": False,
            "topk_group": 1,
            "topk_method": "greedy",
            "torch_dtype": "float16",
            "use_cache": True,
            "v_head_dim": self.v_head_dim,
            "vocab_size": self.vocab,
        }

    def _deepseek_v3_config(self, layers: int) -> dict:
        # zai-org/GLM-4.7-Flash's or deepseek-ai/DeepSeek-V3.2's config.json,
        # less the multi-token-prediction layer and (DeepSeek-V3.2) its YaRN
        # rope scaling, not needed at these lengths.
        dense = min(self.dense_layers, layers)
        cfg = {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.dense_ffn,
            "kv_lora_rank": self.kv_lora_rank,
            "max_position_embeddings": self.max_pos,
            "moe_intermediate_size": self.expert_ffn,
            "n_group": 1 if self.model_type == "glm4_moe_lite" else 8,
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "norm_topk_prob": self.norm_topk_prob,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "num_nextn_predict_layers": 0,
            "q_lora_rank": self.q_lora_rank,
            "qk_nope_head_dim": self.qk_nope_dim,
            "qk_rope_head_dim": self.qk_rope_dim,
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "routed_scaling_factor": self.routed_scale,
            "scoring_func": "sigmoid",
            "tie_word_embeddings": False,
            "topk_group": 1 if self.model_type == "glm4_moe_lite" else 4,
            "topk_method": "noaux_tc",
            "torch_dtype": "float16",
            "use_cache": True,
            "v_head_dim": self.v_head_dim,
            "vocab_size": self.vocab,
        }
        if self.model_type == "glm4_moe_lite":
            # GLM-4.7-Flash names its dense layers in mlp_layer_types (transformers
            # reads no first_k_dense_replace for it) and spells the rope width head_dim.
            cfg["mlp_layer_types"] = ["dense" if i < dense else "sparse" for i in range(layers)]
            cfg["head_dim"] = self.qk_rope_dim
            cfg["rope_interleave"] = True
        else:
            cfg["first_k_dense_replace"] = dense
            cfg["index_n_heads"] = self.index_heads
            cfg["index_head_dim"] = self.index_dim
            cfg["index_topk"] = self.index_topk
        return cfg

    def _minimax_m2_config(self, layers: int) -> dict:
        # MiniMaxAI/MiniMax-M2's config.json, less its FP8 quantization_config
        # (the checkpoint here is f16) and the multi-token-prediction keys.
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "attn_type_list": [1] * layers,
            "bos_token_id": 200034,
            "eos_token_id": 200020,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "intermediate_size": self.expert_ffn,
            "max_position_embeddings": self.max_pos,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "num_local_experts": self.experts,
            "qk_norm_type": "per_layer",
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rotary_dim": int(self.head_dim * self.partial_rotary),
            "scoring_func": "sigmoid",
            "shared_intermediate_size": 0,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "use_cache": True,
            "use_qk_norm": True,
            "use_routing_bias": True,
            "vocab_size": self.vocab,
        }

    def _nemotron_h_config(self, layers: int) -> dict:
        # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json, less the
        # auto_map, with the pattern cut to `layers` blocks. The Mamba2 width is
        # mamba_num_heads x mamba_head_dim (not expand x hidden_size).
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 1,
            "chunk_size": 128,
            "conv_kernel": self.conv_kernel,
            "eos_token_id": 2,
            "expand": 2,
            "head_dim": self.head_dim,
            "hidden_dropout": 0.0,
            "hidden_size": self.hidden,
            "hybrid_override_pattern": self.blocks(layers),
            "initializer_range": 0.02,
            "intermediate_size": self.expert_ffn,
            "layer_norm_epsilon": self.rms_eps,
            "mamba_head_dim": self.mamba_head_dim,
            "mamba_hidden_act": "silu",
            "mamba_num_heads": self.mamba_heads,
            "mamba_proj_bias": False,
            "mamba_ssm_cache_dtype": "float32",
            "max_position_embeddings": self.max_pos,
            "mlp_bias": False,
            "mlp_hidden_act": "relu2",
            "moe_intermediate_size": self.expert_ffn,
            "moe_shared_expert_intermediate_size": self.shared_ffn,
            "n_group": 1,
            "n_groups": self.mamba_groups,
            "n_routed_experts": self.experts,
            "n_shared_experts": 1,
            "norm_eps": self.rms_eps,
            "norm_topk_prob": self.norm_topk_prob,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "num_logits_to_keep": 1,
            "pad_token_id": 0,
            "partial_rotary_factor": 1.0,
            "rescale_prenorm_residual": True,
            "residual_in_fp32": False,
            "rope_theta": self.rope_theta,
            "routed_scaling_factor": self.routed_scale,
            "sliding_window": None,
            "ssm_state_size": self.ssm_state,
            "tie_word_embeddings": False,
            "time_step_floor": 0.0001,
            "time_step_max": 0.1,
            "time_step_min": 0.001,
            "topk_group": 1,
            "torch_dtype": "float16",
            "use_bias": False,
            "use_cache": True,
            "use_conv_bias": True,
            "use_mamba_kernels": True,
            "vocab_size": self.vocab,
        }

    def _deepseek_v4_config(self, layers: int) -> dict:
        # deepseek-ai/DeepSeek-V4-Flash's config.json (DeepSeek's own flat
        # spelling: compress_ratios, num_hash_layers, rope_scaling), less its
        # FP8 / FP4 quantization_config (the checkpoint here is f16) and the
        # multi-token-prediction layer.
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 1,
            # Per layer 0 (window only), 4 (pooled by 4 with the indexer) or
            # 128 (pooled by 128); the Hub list has one more entry, for the MTP layer.
            "compress_ratios": DSV4_COMPRESS_RATIOS[:layers],
            "compress_rope_theta": 160000.0,
            "hc_eps": 1e-6,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "index_head_dim": self.index_dim,
            "index_n_heads": self.index_heads,
            "index_topk": self.index_topk,
            "initializer_range": 0.02,
            "max_position_embeddings": self.max_pos,
            "moe_intermediate_size": self.expert_ffn,
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "norm_topk_prob": self.norm_topk_prob,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hash_layers": 3,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "num_nextn_predict_layers": 0,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_dim,
            "rms_norm_eps": self.rms_eps,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "type": "yarn",
            },
            "rope_theta": self.rope_theta,
            "routed_scaling_factor": self.routed_scale,
            "scoring_func": "sqrtsoftplus",
            "sliding_window": self.sliding_window,
            "swiglu_limit": 10.0,
            "tie_word_embeddings": False,
            "topk_method": "noaux_tc",
            "torch_dtype": "float16",
            "use_cache": True,
            "vocab_size": self.vocab,
        }

    def _qwen3_5_moe_config(self, layers: int) -> dict:
        # Qwen/Qwen3.6-35B-A3B's text_config, spelled as the flat
        # Qwen3_5MoeForCausalLM checkpoint (transformers 5) writes it, less the
        # multi-token-prediction layer (not written here).
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "attn_output_gate": True,
            "bos_token_id": None,
            "dtype": "float16",
            "eos_token_id": 248044,
            "full_attention_interval": self.full_every,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initializer_range": 0.02,
            "layer_types": self.layer_types(layers),
            "linear_conv_kernel_dim": self.conv_kernel,
            "linear_key_head_dim": self.linear_k_dim,
            "linear_num_key_heads": self.linear_k_heads,
            "linear_num_value_heads": self.linear_v_heads,
            "linear_value_head_dim": self.linear_v_dim,
            "max_position_embeddings": self.max_pos,
            "moe_intermediate_size": self.expert_ffn,
            "num_attention_heads": self.heads,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "output_router_logits": False,
            "pad_token_id": None,
            "rms_norm_eps": self.rms_eps,
            "rope_parameters": {
                "mrope_interleaved": True,
                "mrope_section": [11, 11, 10],
                "partial_rotary_factor": self.partial_rotary,
                "rope_theta": self.rope_theta,
                "rope_type": "default",
            },
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": self.shared_ffn,
            "tie_word_embeddings": False,
            "use_cache": True,
            "vocab_size": self.vocab,
        }

    def _gpt_oss_config(self, layers: int) -> dict:
        # openai/gpt-oss-20b's config.json, less its MXFP4 quantization_config
        # (the experts are written in f16 here).
        return {
            "architectures": [self.hf_class],
            "model_type": self.model_type,
            "attention_bias": True,
            "attention_dropout": 0.0,
            "eos_token_id": 200002,
            "experts_per_token": self.top_k,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden,
            "initial_context_length": 4096,
            "initializer_range": 0.02,
            "intermediate_size": self.expert_ffn,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "max_position_embeddings": self.max_pos,
            "num_attention_heads": self.heads,
            "num_experts_per_tok": self.top_k,
            "num_hidden_layers": layers,
            "num_key_value_heads": self.kv_heads,
            "num_local_experts": self.experts,
            "output_router_logits": False,
            "pad_token_id": 199999,
            "rms_norm_eps": self.rms_eps,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": False,
            },
            "rope_theta": self.rope_theta,
            "router_aux_loss_coef": 0.9,
            "sliding_window": self.sliding_window,
            "swiglu_limit": 7.0,
            "tie_word_embeddings": False,
            "torch_dtype": "float16",
            "use_cache": True,
            "vocab_size": self.vocab,
        }


SHAPES = {
    "olmoe": Shape(
        name="olmoe",
        hf_class="OlmoeForCausalLM",
        model_type="olmoe",
        gguf_arch="olmoe",
        hidden=2048,
        experts=64,
        top_k=8,
        expert_ffn=1024,
        heads=16,
        kv_heads=16,
        head_dim=128,
        vocab=50304,
        qk_norm="full",
        norm_topk_prob=False,
        rope_theta=10000.0,
        rms_eps=1e-5,
        max_pos=4096,
    ),
    "qwen3moe": Shape(
        name="qwen3moe",
        hf_class="Qwen3MoeForCausalLM",
        model_type="qwen3_moe",
        gguf_arch="qwen3moe",
        hidden=2048,
        experts=128,
        top_k=8,
        expert_ffn=768,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        qk_norm="per_head",
        norm_topk_prob=True,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        max_pos=40960,
    ),
    "qwen2moe": Shape(
        name="qwen2moe",
        hf_class="Qwen2MoeForCausalLM",
        model_type="qwen2_moe",
        gguf_arch="qwen2moe",
        hidden=2048,
        experts=60,
        top_k=4,
        expert_ffn=1408,
        heads=16,
        kv_heads=16,
        head_dim=128,
        vocab=151936,
        qk_norm="none",
        norm_topk_prob=False,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        max_pos=8192,
        shared_ffn=5632,
    ),
    "deepseek_v2_lite": Shape(
        name="deepseek_v2_lite",
        hf_class="DeepseekV2ForCausalLM",
        model_type="deepseek_v2",
        gguf_arch="deepseek2",
        hidden=2048,
        experts=64,
        top_k=6,
        expert_ffn=1408,
        heads=16,
        kv_heads=16,
        head_dim=192,  # qk_nope + qk_rope
        vocab=102400,
        qk_norm="none",
        norm_topk_prob=False,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_pos=163840,
        shared_experts=2,
        dense_layers=1,
        dense_ffn=10944,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
    ),
    "gpt_oss_20b": Shape(
        name="gpt_oss_20b",
        hf_class="GptOssForCausalLM",
        model_type="gpt_oss",
        gguf_arch="gpt-oss",
        hidden=2880,
        experts=32,
        top_k=4,
        expert_ffn=2880,
        heads=64,
        kv_heads=8,
        head_dim=64,
        vocab=201088,
        qk_norm="none",
        norm_topk_prob=True,
        rope_theta=150000.0,
        rms_eps=1e-5,
        max_pos=131072,
        sliding_window=128,
    ),
    # Qwen/Qwen3.6-35B-A3B (Qwen3.5-MoE architecture, `qwen3_5_moe`): 40 layers
    # on the Hub, in the pattern three Gated DeltaNet layers, one gated full
    # attention layer; vocabulary 248320 (padded) as its model card gives it.
    "qwen3_6": Shape(
        name="qwen3_6",
        hf_class="Qwen3_5MoeForCausalLM",
        model_type="qwen3_5_moe_text",
        gguf_arch="qwen35moe",
        hidden=2048,
        experts=256,
        top_k=8,
        expert_ffn=512,
        heads=16,
        kv_heads=2,
        head_dim=256,
        vocab=248320,
        qk_norm="per_head",
        norm_topk_prob=True,
        rope_theta=10000000.0,
        rms_eps=1e-6,
        max_pos=262144,
        shared_ffn=512,
        linear_k_heads=16,
        linear_v_heads=32,
        linear_k_dim=128,
        linear_v_dim=128,
        conv_kernel=4,
        full_every=4,
        partial_rotary=0.25,
        hub_layers=40,
    ),
    # zai-org/GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's latent attention
    # (q latent 768, kv latent 512, 20 heads of 192 + 64 / 256) under 64 routed
    # experts, top-4, sigmoid routing with a correction bias, one shared
    # expert; layer 0 dense as on the Hub (47 layers there).
    "glm4_7_flash": Shape(
        name="glm4_7_flash",
        hf_class="Glm4MoeLiteForCausalLM",
        model_type="glm4_moe_lite",
        gguf_arch="deepseek2",
        hidden=2048,
        experts=64,
        top_k=4,
        expert_ffn=1536,
        heads=20,
        kv_heads=20,
        head_dim=256,  # qk_nope + qk_rope
        vocab=154880,
        qk_norm="none",
        norm_topk_prob=True,
        rope_theta=1000000.0,
        rms_eps=1e-5,
        max_pos=202752,
        shared_experts=1,
        dense_layers=1,
        dense_ffn=10240,
        kv_lora_rank=512,
        qk_nope_dim=192,
        qk_rope_dim=64,
        v_head_dim=256,
        q_lora_rank=768,
        sigmoid_router=True,
        routed_scale=1.8,
        hub_layers=47,
    ),
    # deepseek-ai/DeepSeek-V3.2 (`deepseek_v32`): DeepSeek Sparse Attention,
    # MLA of 128 heads behind a lightning indexer (64 heads of 128, 2048 keys
    # kept) at hidden 7168. The Hub model's first three layers are dense
    # (18432 wide) and the rest have 256 experts of 2048, top-8, plus one
    # shared; here all four layers are dense: a dense layer reads the bytes
    # of a MoE layer's 8 routed + 1 shared experts per token (9 x 2048 =
    # 18432), and the checkpoint stays 8.5 GB instead of 30 GB.
    "deepseek_v32": Shape(
        name="deepseek_v32",
        hf_class="DeepseekV32ForCausalLM",
        model_type="deepseek_v32",
        gguf_arch="deepseek32",
        hidden=7168,
        experts=256,
        top_k=8,
        expert_ffn=2048,
        heads=128,
        kv_heads=128,
        head_dim=192,
        vocab=129280,
        qk_norm="none",
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_pos=163840,
        shared_experts=1,
        dense_layers=4,
        dense_ffn=18432,
        kv_lora_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        q_lora_rank=1536,
        sigmoid_router=True,
        routed_scale=2.5,
        index_heads=64,
        index_dim=128,
        index_topk=2048,
        hub_layers=61,
    ),
    # MiniMaxAI/MiniMax-M2 (`minimax_m2`): GQA 48 / 8 heads of 128 with q/k
    # norms over the whole projection and rope on 64 of 128, experts of 1536,
    # top-8, sigmoid routing with a correction bias, no shared expert, 62
    # layers on the Hub. 64 of the released 256 experts per layer: 4 layers of
    # 256 are a 29 GB f16 checkpoint; a decoded token reads the same bytes
    # either way (8 experts a layer), prefill gives each expert 4x the rows.
    "minimax_m2": Shape(
        name="minimax_m2",
        hf_class="MiniMaxM2ForCausalLM",
        model_type="minimax_m2",
        gguf_arch="minimax-m2",
        hidden=3072,
        experts=64,
        top_k=8,
        expert_ffn=1536,
        heads=48,
        kv_heads=8,
        head_dim=128,
        vocab=200064,
        qk_norm="full",
        norm_topk_prob=True,
        rope_theta=5000000.0,
        rms_eps=1e-6,
        max_pos=196608,
        partial_rotary=0.5,
        sigmoid_router=True,
        hub_layers=62,
    ),
    # nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B (`nemotron_h`): 52 blocks on the
    # Hub, 23 Mamba2 (64 heads of 64, 8 groups, state 128), 23 MoE (128
    # relu2 experts of 1856, top-6, sigmoid routing with a correction bias,
    # x2.5, one shared expert of 3712) and 6 GQA attention (32 / 2 heads of
    # 128, no RoPE). `--layers 7` is "MEMEM*E": every kind of block, and a
    # MoE block after the attention one.
    "nemotron3_nano": Shape(
        name="nemotron3_nano",
        hf_class="NemotronHForCausalLM",
        model_type="nemotron_h",
        gguf_arch="nemotron_h_moe",
        hidden=2688,
        experts=128,
        top_k=6,
        expert_ffn=1856,
        heads=32,
        kv_heads=2,
        head_dim=128,
        vocab=131072,
        qk_norm="none",
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_eps=1e-5,
        max_pos=262144,
        shared_ffn=3712,
        conv_kernel=4,
        hub_layers=52,
        sigmoid_router=True,
        routed_scale=2.5,
        pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        mamba_heads=64,
        mamba_head_dim=64,
        mamba_groups=8,
        ssm_state=128,
    ),
    # deepseek-ai/DeepSeek-V4-Flash (`deepseek_v4`): one shared key = value
    # head of 512 under 64 query heads (query latent 1024, rope on the last
    # 64), grouped output projection 8 x 1024, a 128-token window plus, per
    # layer, nothing / a pool by 4 read through a lightning indexer (64 heads
    # of 128, 512 kept) / a pool by 128; four hyper-connection streams;
    # sqrt(softplus) routing with a correction bias (hash-routed by token id
    # in the first three layers), experts of 2048, top-6, one shared, 43
    # layers on the Hub. 64 of the released 256 experts per layer: 4 layers
    # of 256 are a 52 GB f16 checkpoint; a decoded token reads the same bytes
    # either way (6 experts a layer), prefill gives each expert 4x the rows.
    "deepseek_v4_flash": Shape(
        name="deepseek_v4_flash",
        hf_class="DeepseekV4ForCausalLM",
        model_type="deepseek_v4",
        gguf_arch="deepseek4",
        hidden=4096,
        experts=64,
        top_k=6,
        expert_ffn=2048,
        heads=64,
        kv_heads=1,
        head_dim=512,
        vocab=129280,
        qk_norm="none",
        norm_topk_prob=True,
        rope_theta=10000.0,
        rms_eps=1e-6,
        max_pos=1048576,
        shared_experts=1,
        qk_rope_dim=64,
        sliding_window=128,
        hub_layers=43,
        q_lora_rank=1024,
        routed_scale=1.5,
        index_heads=64,
        index_dim=128,
        index_topk=512,
    ),
}

# DeepSeek-V4-Flash's compress_ratios for its 43 layers and MTP layer.
DSV4_COMPRESS_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]

# The shapes written when --shapes is not given (the first two of the suite).
DEFAULT_SHAPES = "olmoe,qwen3moe"

# "MXFP4" is GPT-OSS's own layout: routed experts in MXFP4, every other matrix Q4_0.
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "MXFP4")


@dataclass(frozen=True)
class Tensor:
    """One Hub tensor: name, shape ([out, in] for matrices) and how to draw it."""

    name: str
    shape: tuple[int, ...]
    # "matrix" ([out, in]), "matrix_t" (stacked [.., in, out], used as x @ W),
    # "embed", "router", "norm", "bias" or "sink"; DeepSeek-V4 adds "hc_fn",
    # "hc_base", "hc_scale", "ape" and "tid2eid"
    kind: str
    # The safetensors dtype: "F16", or as the Hub stores it ("F32", "I64").
    dtype: str = "F16"


def hf_tensors(s: Shape, layers: int) -> list[Tensor]:
    """Every tensor of the Hub checkpoint, in file order."""
    if s.model_type in ("deepseek_v2", "glm4_moe_lite", "deepseek_v32"):
        return _deepseek_v2_tensors(s, layers)
    if s.model_type == "minimax_m2":
        return _minimax_m2_tensors(s, layers)
    if s.model_type == "deepseek_v4":
        return _deepseek_v4_tensors(s, layers)
    if s.model_type == "gpt_oss":
        return _gpt_oss_tensors(s, layers)
    if s.model_type == "qwen3_5_moe_text":
        return _qwen3_5_moe_tensors(s, layers)
    if s.model_type == "nemotron_h":
        return _nemotron_h_tensors(s, layers)
    d, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    qn, kn = (q, kv) if s.qk_norm == "full" else (s.head_dim, s.head_dim)
    out = [Tensor("model.embed_tokens.weight", (s.vocab, d), "embed")]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        out.append(Tensor(f"{p}.input_layernorm.weight", (d,), "norm"))
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            out.append(Tensor(f"{p}.self_attn.{name}_proj.weight", (rows, d), "matrix"))
            if s.model_type == "qwen2_moe":
                out.append(Tensor(f"{p}.self_attn.{name}_proj.bias", (rows,), "bias"))
        out.append(Tensor(f"{p}.self_attn.o_proj.weight", (d, q), "matrix"))
        if s.qk_norm != "none":
            out += [
                Tensor(f"{p}.self_attn.q_norm.weight", (qn,), "norm"),
                Tensor(f"{p}.self_attn.k_norm.weight", (kn,), "norm"),
            ]
        out += [
            Tensor(f"{p}.post_attention_layernorm.weight", (d,), "norm"),
            Tensor(f"{p}.mlp.gate.weight", (s.experts, d), "router"),
        ]
        for e in range(s.experts):
            f = s.expert_ffn
            out += [
                Tensor(f"{p}.mlp.experts.{e}.gate_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.up_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.down_proj.weight", (d, f), "matrix"),
            ]
        if s.shared_ffn:
            g = s.shared_ffn
            out += [
                Tensor(f"{p}.mlp.shared_expert.gate_proj.weight", (g, d), "matrix"),
                Tensor(f"{p}.mlp.shared_expert.up_proj.weight", (g, d), "matrix"),
                Tensor(f"{p}.mlp.shared_expert.down_proj.weight", (d, g), "matrix"),
                Tensor(f"{p}.mlp.shared_expert_gate.weight", (1, d), "router"),
            ]
    out += [Tensor("model.norm.weight", (d,), "norm"), Tensor("lm_head.weight", (s.vocab, d), "matrix")]
    return out


def _deepseek_v2_tensors(s: Shape, layers: int) -> list[Tensor]:
    d, h = s.hidden, s.heads
    qk = s.qk_nope_dim + s.qk_rope_dim
    out = [Tensor("model.embed_tokens.weight", (s.vocab, d), "embed")]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        out.append(Tensor(f"{p}.input_layernorm.weight", (d,), "norm"))
        if s.q_lora_rank:
            out += [
                Tensor(f"{a}.q_a_proj.weight", (s.q_lora_rank, d), "matrix"),
                Tensor(f"{a}.q_a_layernorm.weight", (s.q_lora_rank,), "norm"),
                Tensor(f"{a}.q_b_proj.weight", (h * qk, s.q_lora_rank), "matrix"),
            ]
        else:
            out.append(Tensor(f"{a}.q_proj.weight", (h * qk, d), "matrix"))
        out += [
            Tensor(f"{a}.kv_a_proj_with_mqa.weight", (s.kv_lora_rank + s.qk_rope_dim, d), "matrix"),
            Tensor(f"{a}.kv_a_layernorm.weight", (s.kv_lora_rank,), "norm"),
            Tensor(f"{a}.kv_b_proj.weight", (h * (s.qk_nope_dim + s.v_head_dim), s.kv_lora_rank), "matrix"),
            Tensor(f"{a}.o_proj.weight", (d, h * s.v_head_dim), "matrix"),
        ]
        if s.index_heads:
            x = f"{a}.indexer"
            out += [
                Tensor(f"{x}.wq_b.weight", (s.index_heads * s.index_dim, s.q_lora_rank), "matrix"),
                Tensor(f"{x}.wk.weight", (s.index_dim, d), "matrix"),
                Tensor(f"{x}.k_norm.weight", (s.index_dim,), "norm"),
                Tensor(f"{x}.k_norm.bias", (s.index_dim,), "bias"),
                Tensor(f"{x}.weights_proj.weight", (s.index_heads, d), "matrix"),
            ]
        out.append(Tensor(f"{p}.post_attention_layernorm.weight", (d,), "norm"))
        if layer < s.dense_layers:
            f = s.dense_ffn
            out += [
                Tensor(f"{p}.mlp.gate_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.up_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.down_proj.weight", (d, f), "matrix"),
            ]
            continue
        out.append(Tensor(f"{p}.mlp.gate.weight", (s.experts, d), "router"))
        if s.sigmoid_router:
            out.append(Tensor(f"{p}.mlp.gate.e_score_correction_bias", (s.experts,), "bias"))
        f = s.expert_ffn
        for e in range(s.experts):
            out += [
                Tensor(f"{p}.mlp.experts.{e}.gate_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.up_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.down_proj.weight", (d, f), "matrix"),
            ]
        fs = f * s.shared_experts
        out += [
            Tensor(f"{p}.mlp.shared_experts.gate_proj.weight", (fs, d), "matrix"),
            Tensor(f"{p}.mlp.shared_experts.up_proj.weight", (fs, d), "matrix"),
            Tensor(f"{p}.mlp.shared_experts.down_proj.weight", (d, fs), "matrix"),
        ]
    out += [Tensor("model.norm.weight", (d,), "norm"), Tensor("lm_head.weight", (s.vocab, d), "matrix")]
    return out


def _minimax_m2_tensors(s: Shape, layers: int) -> list[Tensor]:
    """MiniMaxM2ForCausalLM's tensors: q/k norms over the whole projection,
    Mixtral's block_sparse_moe names (w1 gate, w3 up, w2 down) and the
    router's correction bias."""
    d, q, kv, f = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.expert_ffn
    out = [Tensor("model.embed_tokens.weight", (s.vocab, d), "embed")]
    for layer in range(layers):
        p, a, m = (
            f"model.layers.{layer}",
            f"model.layers.{layer}.self_attn",
            f"model.layers.{layer}.block_sparse_moe",
        )
        out += [
            Tensor(f"{p}.input_layernorm.weight", (d,), "norm"),
            Tensor(f"{a}.q_proj.weight", (q, d), "matrix"),
            Tensor(f"{a}.k_proj.weight", (kv, d), "matrix"),
            Tensor(f"{a}.v_proj.weight", (kv, d), "matrix"),
            Tensor(f"{a}.o_proj.weight", (d, q), "matrix"),
            Tensor(f"{a}.q_norm.weight", (q,), "norm"),
            Tensor(f"{a}.k_norm.weight", (kv,), "norm"),
            Tensor(f"{p}.post_attention_layernorm.weight", (d,), "norm"),
            Tensor(f"{m}.gate.weight", (s.experts, d), "router"),
            Tensor(f"{m}.e_score_correction_bias", (s.experts,), "bias"),
        ]
        for e in range(s.experts):
            out += [
                Tensor(f"{m}.experts.{e}.w1.weight", (f, d), "matrix"),
                Tensor(f"{m}.experts.{e}.w3.weight", (f, d), "matrix"),
                Tensor(f"{m}.experts.{e}.w2.weight", (d, f), "matrix"),
            ]
    out += [Tensor("model.norm.weight", (d,), "norm"), Tensor("lm_head.weight", (s.vocab, d), "matrix")]
    return out


def _nemotron_h_tensors(s: Shape, layers: int) -> list[Tensor]:
    """NemotronHForCausalLM's tensors in the Hub's layout (`backbone.*`, one
    block per layer, each with its own `norm` and `mixer`, experts one by one).

    Mamba2's ``in_proj`` rows are z (I), x (I), B (G·N), C (G·N), dt (H), the
    convolution runs over x, B, C; drawn as a fresh Mamba2 is initialised:
    A ~ U(1, 16), dt = softplus(. + dt_bias) log-uniform in [1e-3, 0.1] at a
    zero input, D around 1, the convolution at 1/sqrt(kernel)."""
    d, f, g = s.hidden, s.expert_ffn, s.shared_ffn
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    i, gn, h = s.mamba_heads * s.mamba_head_dim, s.mamba_groups * s.ssm_state, s.mamba_heads
    out = [Tensor("backbone.embeddings.weight", (s.vocab, d), "embed")]
    for layer, kind in enumerate(s.blocks(layers)):
        p, m = f"backbone.layers.{layer}", f"backbone.layers.{layer}.mixer"
        out.append(Tensor(f"{p}.norm.weight", (d,), "norm"))
        if kind == "M":
            out += [
                Tensor(f"{m}.A_log", (h,), "a_log"),
                Tensor(f"{m}.D", (h,), "norm"),
                Tensor(f"{m}.conv1d.weight", (i + 2 * gn, 1, s.conv_kernel), "matrix"),
                Tensor(f"{m}.conv1d.bias", (i + 2 * gn,), "bias"),
                Tensor(f"{m}.dt_bias", (h,), "dt_bias"),
                Tensor(f"{m}.in_proj.weight", (2 * i + 2 * gn + h, d), "matrix"),
                Tensor(f"{m}.norm.weight", (i,), "norm"),
                Tensor(f"{m}.out_proj.weight", (d, i), "matrix"),
            ]
        elif kind == "*":
            out += [
                Tensor(f"{m}.q_proj.weight", (q, d), "matrix"),
                Tensor(f"{m}.k_proj.weight", (kv, d), "matrix"),
                Tensor(f"{m}.v_proj.weight", (kv, d), "matrix"),
                Tensor(f"{m}.o_proj.weight", (d, q), "matrix"),
            ]
        else:
            out += [
                Tensor(f"{m}.gate.weight", (s.experts, d), "router"),
                Tensor(f"{m}.gate.e_score_correction_bias", (s.experts,), "bias"),
            ]
            for e in range(s.experts):
                out += [
                    Tensor(f"{m}.experts.{e}.up_proj.weight", (f, d), "matrix"),
                    Tensor(f"{m}.experts.{e}.down_proj.weight", (d, f), "matrix"),
                ]
            out += [
                Tensor(f"{m}.shared_experts.up_proj.weight", (g, d), "matrix"),
                Tensor(f"{m}.shared_experts.down_proj.weight", (d, g), "matrix"),
            ]
    out += [Tensor("backbone.norm_f.weight", (d,), "norm"), Tensor("lm_head.weight", (s.vocab, d), "matrix")]
    return out


def _deepseek_v4_tensors(s: Shape, layers: int) -> list[Tensor]:
    """DeepSeek-V4's tensors under DeepSeek's own root-level names (``embed``,
    ``layers.N.attn.wq_a``, ``layers.N.ffn.experts.E.w1``, ...), as the Hub
    checkpoint and llama.cpp's converter spell them. The hyper-connection
    tensors, attention sinks, pool position biases (``ape``) and the
    router's correction bias are f32 and ``tid2eid`` int64, as on the Hub."""
    cfg = s.hf_config(layers)
    d, h, hd, q, f = s.hidden, s.heads, s.head_dim, s.q_lora_rank, s.expert_ffn
    hc, og, ol = cfg["hc_mult"], cfg["o_groups"], cfg["o_lora_rank"]
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc x hc) weights
    ih, idim = s.index_heads, s.index_dim

    def f32(name, shape, kind):
        return Tensor(name, shape, kind, "F32")

    out = [Tensor("embed.weight", (s.vocab, d), "embed")]
    for layer in range(layers):
        p, a, m = f"layers.{layer}", f"layers.{layer}.attn", f"layers.{layer}.ffn"
        ratio = cfg["compress_ratios"][layer]
        out += [
            Tensor(f"{p}.attn_norm.weight", (d,), "norm"),
            f32(f"{p}.hc_attn_fn", (mix, hc * d), "hc_fn"),
            f32(f"{p}.hc_attn_base", (mix,), "hc_base"),
            f32(f"{p}.hc_attn_scale", (3,), "hc_scale"),
            Tensor(f"{a}.wq_a.weight", (q, d), "matrix"),
            Tensor(f"{a}.q_norm.weight", (q,), "norm"),
            Tensor(f"{a}.wq_b.weight", (h * hd, q), "matrix"),
            Tensor(f"{a}.wkv.weight", (hd, d), "matrix"),
            Tensor(f"{a}.kv_norm.weight", (hd,), "norm"),
            # og groups of h/og heads, each group projected to ol.
            Tensor(f"{a}.wo_a.weight", (og * ol, h * hd // og), "matrix"),
            Tensor(f"{a}.wo_b.weight", (d, og * ol), "matrix"),
            f32(f"{a}.attn_sink", (h,), "sink"),
        ]
        if ratio:
            # A pool by 4 reads its block and the previous one: two entries wide.
            c = 2 if ratio == 4 else 1
            out += [
                Tensor(f"{a}.compressor.wkv.weight", (c * hd, d), "matrix"),
                Tensor(f"{a}.compressor.wgate.weight", (c * hd, d), "matrix"),
                f32(f"{a}.compressor.ape", (ratio, c * hd), "ape"),
                Tensor(f"{a}.compressor.norm.weight", (hd,), "norm"),
            ]
        if ratio == 4:
            x = f"{a}.indexer"
            out += [
                Tensor(f"{x}.wq_b.weight", (ih * idim, q), "matrix"),
                Tensor(f"{x}.weights_proj.weight", (ih, d), "matrix"),
                Tensor(f"{x}.compressor.wkv.weight", (2 * idim, d), "matrix"),
                Tensor(f"{x}.compressor.wgate.weight", (2 * idim, d), "matrix"),
                f32(f"{x}.compressor.ape", (4, 2 * idim), "ape"),
                Tensor(f"{x}.compressor.norm.weight", (idim,), "norm"),
            ]
        out += [
            Tensor(f"{p}.ffn_norm.weight", (d,), "norm"),
            f32(f"{p}.hc_ffn_fn", (mix, hc * d), "hc_fn"),
            f32(f"{p}.hc_ffn_base", (mix,), "hc_base"),
            f32(f"{p}.hc_ffn_scale", (3,), "hc_scale"),
            Tensor(f"{m}.gate.weight", (s.experts, d), "router"),
        ]
        if layer < cfg["num_hash_layers"]:
            out.append(Tensor(f"{m}.gate.tid2eid", (s.vocab, s.top_k), "tid2eid", "I64"))
        else:
            out.append(f32(f"{m}.gate.bias", (s.experts,), "bias"))
        for e in range(s.experts):
            out += [
                Tensor(f"{m}.experts.{e}.w1.weight", (f, d), "matrix"),
                Tensor(f"{m}.experts.{e}.w3.weight", (f, d), "matrix"),
                Tensor(f"{m}.experts.{e}.w2.weight", (d, f), "matrix"),
            ]
        fs = f * s.shared_experts
        out += [
            Tensor(f"{m}.shared_experts.w1.weight", (fs, d), "matrix"),
            Tensor(f"{m}.shared_experts.w3.weight", (fs, d), "matrix"),
            Tensor(f"{m}.shared_experts.w2.weight", (d, fs), "matrix"),
        ]
    out += [
        f32("hc_head_fn", (hc, hc * d), "hc_fn"),
        f32("hc_head_base", (hc,), "hc_base"),
        f32("hc_head_scale", (1,), "hc_scale"),
        Tensor("norm.weight", (d,), "norm"),
        Tensor("head.weight", (s.vocab, d), "matrix"),
    ]
    return out


def _qwen3_5_moe_tensors(s: Shape, layers: int) -> list[Tensor]:
    """Qwen3_5MoeForCausalLM's tensors: the flat linear-attention projections
    (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), experts one by one."""
    d, f, g = s.hidden, s.expert_ffn, s.shared_ffn
    kd, vd, hv = s.linear_k_heads * s.linear_k_dim, s.linear_v_heads * s.linear_v_dim, s.linear_v_heads
    out = [Tensor("model.embed_tokens.weight", (s.vocab, d), "embed")]
    for layer, kind in enumerate(s.layer_types(layers)):
        p = f"model.layers.{layer}"
        out.append(Tensor(f"{p}.input_layernorm.weight", (d,), "norm0"))
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            out += [
                Tensor(f"{a}.in_proj_qkv.weight", (2 * kd + vd, d), "matrix"),
                Tensor(f"{a}.in_proj_z.weight", (vd, d), "matrix"),
                Tensor(f"{a}.in_proj_b.weight", (hv, d), "matrix"),
                Tensor(f"{a}.in_proj_a.weight", (hv, d), "matrix"),
                Tensor(f"{a}.conv1d.weight", (2 * kd + vd, 1, s.conv_kernel), "matrix"),
                Tensor(f"{a}.A_log", (hv,), "a_log"),
                Tensor(f"{a}.dt_bias", (hv,), "dt_bias"),
                Tensor(f"{a}.norm.weight", (s.linear_v_dim,), "norm"),
                Tensor(f"{a}.out_proj.weight", (d, vd), "matrix"),
            ]
        else:
            a, q, kv = f"{p}.self_attn", s.heads * s.head_dim, s.kv_heads * s.head_dim
            out += [
                # Per head: the query's head_dim rows, then its output gate's.
                Tensor(f"{a}.q_proj.weight", (2 * q, d), "matrix"),
                Tensor(f"{a}.k_proj.weight", (kv, d), "matrix"),
                Tensor(f"{a}.v_proj.weight", (kv, d), "matrix"),
                Tensor(f"{a}.o_proj.weight", (d, q), "matrix"),
                Tensor(f"{a}.q_norm.weight", (s.head_dim,), "norm0"),
                Tensor(f"{a}.k_norm.weight", (s.head_dim,), "norm0"),
            ]
        out += [
            Tensor(f"{p}.post_attention_layernorm.weight", (d,), "norm0"),
            Tensor(f"{p}.mlp.gate.weight", (s.experts, d), "router"),
        ]
        for e in range(s.experts):
            out += [
                Tensor(f"{p}.mlp.experts.{e}.gate_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.up_proj.weight", (f, d), "matrix"),
                Tensor(f"{p}.mlp.experts.{e}.down_proj.weight", (d, f), "matrix"),
            ]
        out += [
            Tensor(f"{p}.mlp.shared_expert.gate_proj.weight", (g, d), "matrix"),
            Tensor(f"{p}.mlp.shared_expert.up_proj.weight", (g, d), "matrix"),
            Tensor(f"{p}.mlp.shared_expert.down_proj.weight", (d, g), "matrix"),
            Tensor(f"{p}.mlp.shared_expert_gate.weight", (1, d), "router"),
        ]
    out += [Tensor("model.norm.weight", (d,), "norm0"), Tensor("lm_head.weight", (s.vocab, d), "matrix")]
    return out


def _gpt_oss_tensors(s: Shape, layers: int) -> list[Tensor]:
    d, q, kv, e, f = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.experts, s.expert_ffn
    out = [Tensor("model.embed_tokens.weight", (s.vocab, d), "embed")]
    for layer in range(layers):
        p = f"model.layers.{layer}"
        a = f"{p}.self_attn"
        out += [
            Tensor(f"{p}.input_layernorm.weight", (d,), "norm"),
            Tensor(f"{a}.q_proj.weight", (q, d), "matrix"),
            Tensor(f"{a}.q_proj.bias", (q,), "bias"),
            Tensor(f"{a}.k_proj.weight", (kv, d), "matrix"),
            Tensor(f"{a}.k_proj.bias", (kv,), "bias"),
            Tensor(f"{a}.v_proj.weight", (kv, d), "matrix"),
            Tensor(f"{a}.v_proj.bias", (kv,), "bias"),
            Tensor(f"{a}.o_proj.weight", (d, q), "matrix"),
            Tensor(f"{a}.o_proj.bias", (d,), "bias"),
            Tensor(f"{a}.sinks", (s.heads,), "sink"),
            Tensor(f"{p}.post_attention_layernorm.weight", (d,), "norm"),
            Tensor(f"{p}.mlp.router.weight", (e, d), "router"),
            Tensor(f"{p}.mlp.router.bias", (e,), "bias"),
            # Stacked experts used as x @ W: gate_up [E, D, 2F] (gate = even
            # columns, up = odd), down [E, F, D].
            Tensor(f"{p}.mlp.experts.gate_up_proj", (e, d, 2 * f), "matrix_t"),
            Tensor(f"{p}.mlp.experts.gate_up_proj_bias", (e, 2 * f), "bias"),
            Tensor(f"{p}.mlp.experts.down_proj", (e, f, d), "matrix_t"),
            Tensor(f"{p}.mlp.experts.down_proj_bias", (e, d), "bias"),
        ]
    out += [Tensor("model.norm.weight", (d,), "norm"), Tensor("lm_head.weight", (s.vocab, d), "matrix")]
    return out


def draw(shape_name: str, t: Tensor) -> np.ndarray:
    """Deterministic values of one tensor (f32), seeded by its name."""
    rng = np.random.default_rng(zlib.crc32(f"{shape_name}/{t.name}".encode()))
    x = rng.standard_normal(t.shape, dtype=np.float32)
    if t.kind == "norm":
        return 1.0 + np.float32(0.1) * x
    if t.kind == "norm0":
        # Zero-centred: the model scales by 1 + w.
        return np.float32(0.1) * x
    if t.kind == "a_log":
        # As the Gated DeltaNet layers are initialised: A ~ U(1, 16).
        u = rng.random(t.shape, dtype=np.float32)
        return np.log(1.0 + 15.0 * u).astype(np.float32)
    if t.kind == "dt_bias":
        # softplus(dt_bias) = dt, dt log-uniform in [1e-3, 0.1].
        u = rng.random(t.shape, dtype=np.float32)
        dt = np.exp(np.log(1e-3) + u * (np.log(0.1) - np.log(1e-3)))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    if t.kind in ("embed", "sink", "ape"):
        return x
    if t.kind == "tid2eid":
        # Each token's experts: top_k distinct ids of [0, experts) in random order.
        experts = SHAPES[shape_name].experts
        keys = rng.random((t.shape[0], experts), dtype=np.float32)
        return np.argsort(keys, axis=1)[:, : t.shape[1]].astype(np.int64)
    if t.kind == "hc_base":
        return np.float32(0.5) * x
    if t.kind == "hc_scale":
        # Positive, around 1: the mixing logits are (normed x . fn) * scale + base.
        return (0.5 + rng.random(t.shape, dtype=np.float32)).astype(np.float32)
    if t.kind == "bias":
        return np.float32(0.1) * x
    scale = 1.0 / np.sqrt(t.shape[-2] if t.kind == "matrix_t" else t.shape[-1])
    if t.kind in ("router", "hc_fn"):
        # (hc_fn: mixing logits of spread ~2, so the streams' weights and the
        # Sinkhorn matrix are neither uniform nor one-hot)
        scale *= 2.0
    x *= np.float32(scale)
    return x


# The shapes --mtp can give a multi-token-prediction layer (Qwen3-Next's
# layout, which colibri's converter reads for any family).
MTP_SHAPES = ("qwen3moe",)


def mtp_tensors(s: Shape, layers: int) -> list[Tensor]:
    """One multi-token-prediction layer as Qwen3-Next and Qwen3.5 store it:
    the two input norms, `mtp.fc` ([D, 2D], over the normed embedding then
    the normed hidden state), a decoder layer named as layer `layers` would
    be but under `mtp.layers.0.`, and the output norm."""
    d = s.hidden
    p = f"model.layers.{layers}."
    layer = [t for t in hf_tensors(s, layers + 1) if t.name.startswith(p)]
    return [
        Tensor("mtp.pre_fc_norm_embedding.weight", (d,), "norm"),
        Tensor("mtp.pre_fc_norm_hidden.weight", (d,), "norm"),
        Tensor("mtp.fc.weight", (d, 2 * d), "matrix"),
        *[Tensor("mtp.layers.0." + t.name[len(p) :], t.shape, t.kind) for t in layer],
        Tensor("mtp.norm.weight", (d,), "norm"),
    ]


def param_count(s: Shape, layers: int, mtp: bool = False) -> int:
    extra = mtp_tensors(s, layers) if mtp else []
    return sum(int(np.prod(t.shape)) for t in hf_tensors(s, layers) + extra)


def model_dir(s: Shape, layers: int, root: Path = CACHE, mtp: bool = False) -> Path:
    return root / f"{s.name}-l{layers}{'-mtp' if mtp else ''}"


# ---------------------------------------------------------------- safetensors


def write_safetensors(s: Shape, layers: int, path: Path, log, tensors: list[Tensor] | None = None) -> None:
    """Streams every tensor (or those of `tensors`), drawn and rounded to
    f16, into one safetensors file."""
    if tensors is None:
        tensors = hf_tensors(s, layers)
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for t in tensors:
        n = int(np.prod(t.shape)) * np.dtype(ST_DTYPES[t.dtype]).itemsize
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_suffix(".tmp")
    t0 = time.time()
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for i, t in enumerate(tensors):
            f.write(draw(s.name, t).astype(ST_DTYPES[t.dtype]).tobytes())
            if i % 200 == 0:
                log(
                    f"  safetensors {i}/{len(tensors)} tensors, {f.tell() / 1e9:.2f} GB, "
                    f"{time.time() - t0:.0f}s"
                )
    os.replace(tmp, path)


# safetensors dtype names -> NumPy (BF16 is read as its raw 16 bits).
ST_DTYPES = {"F16": np.float16, "F32": np.float32, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}


class SafetensorsFile:
    """Read-only memory map of one safetensors file: name -> NumPy view."""

    def __init__(self, path: Path):
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        n = int.from_bytes(raw[:8].tobytes(), "little")
        self.header = json.loads(raw[8 : 8 + n].tobytes())
        self.raw = raw
        self.base = 8 + n

    def get(self, name: str) -> np.ndarray:
        h = self.header[name]
        dt = ST_DTYPES[h["dtype"]]
        a, b = h["data_offsets"]
        return self.raw[self.base + a : self.base + b].view(dt).reshape(h["shape"])


class DrawnCheckpoint:
    """The checkpoint's tensors drawn again instead of read (``SafetensorsFile``'s
    interface): the same values, bit for bit, without the file on disk."""

    def __init__(self, s: Shape, layers: int):
        self.shape_name = s.name
        self.tensors = {t.name: t for t in hf_tensors(s, layers)}
        self.header = {t.name: {"dtype": t.dtype, "shape": list(t.shape)} for t in self.tensors.values()}

    def get(self, name: str) -> np.ndarray:
        t = self.tensors[name]
        return draw(self.shape_name, t).astype(ST_DTYPES[t.dtype])


# ---------------------------------------------------------------- GGUF


@dataclass(frozen=True)
class Entry:
    """One GGUF tensor: its name, the Hub tensors it is made of, and how.

    Without ``parts``, the Hub tensors are stacked (several) or copied (one).
    With it, ``parts(st)`` gives the 2-D blocks whose rows, one block after
    the other, are the tensor's rows (``shape`` is then the GGUF tensor's
    NumPy shape, outermost first); for a "norm" entry ``parts`` gives the
    whole array. "norm" entries (norms, biases, sinks, routers) stay f32.
    """

    name: str
    hf: tuple[str, ...]
    kind: str  # "matrix" (takes the file's type), "norm" (f32) or "int32"
    parts: Callable | None = None
    shape: tuple[int, ...] | None = None


def gguf_plan(s: Shape, layers: int) -> list[Entry]:
    """The GGUF tensors in file order.

    Experts are stacked as llama.cpp's converter does: ``[E, F, D]`` for
    gate/up and ``[E, D, F]`` for down (GGUF reverses the dimensions, so
    llama.cpp sees ``{D, F, E}`` and ``{F, D, E}``).
    """
    if s.model_type in ("deepseek_v2", "glm4_moe_lite"):
        return _deepseek_v2_plan(s, layers)
    if s.model_type == "minimax_m2":
        return _minimax_m2_plan(s, layers)
    if s.model_type == "deepseek_v4":
        return _deepseek_v4_plan(s, layers)
    if s.model_type == "gpt_oss":
        return _gpt_oss_plan(s, layers)
    if s.model_type == "deepseek_v32":
        raise ValueError(f"{s.name}: no GGUF layout here (the DSA shape is timed in colibri only)")
    if s.model_type == "qwen3_5_moe_text":
        return _qwen35moe_plan(s, layers)
    if s.model_type == "nemotron_h":
        return _nemotron_h_plan(s, layers)

    def e(name, hf, kind):
        return Entry(name, tuple(hf), kind)

    plan = [e("token_embd.weight", ["model.embed_tokens.weight"], "matrix")]
    for layer in range(layers):
        p, b = f"model.layers.{layer}", f"blk.{layer}"
        plan.append(e(f"{b}.attn_norm.weight", [f"{p}.input_layernorm.weight"], "norm"))
        for gg, hf in (("q", "q"), ("k", "k"), ("v", "v")):
            plan.append(e(f"{b}.attn_{gg}.weight", [f"{p}.self_attn.{hf}_proj.weight"], "matrix"))
            if s.model_type == "qwen2_moe":
                plan.append(e(f"{b}.attn_{gg}.bias", [f"{p}.self_attn.{hf}_proj.bias"], "norm"))
        plan.append(e(f"{b}.attn_output.weight", [f"{p}.self_attn.o_proj.weight"], "matrix"))
        if s.qk_norm != "none":
            plan += [
                e(f"{b}.attn_q_norm.weight", [f"{p}.self_attn.q_norm.weight"], "norm"),
                e(f"{b}.attn_k_norm.weight", [f"{p}.self_attn.k_norm.weight"], "norm"),
            ]
        plan += [
            e(f"{b}.ffn_norm.weight", [f"{p}.post_attention_layernorm.weight"], "norm"),
            # The router stays f32, as llama.cpp's converter and colibri both keep it.
            e(f"{b}.ffn_gate_inp.weight", [f"{p}.mlp.gate.weight"], "norm"),
        ]
        for gg, hf in (
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_up_exps", "up_proj"),
            ("ffn_down_exps", "down_proj"),
        ):
            names = [f"{p}.mlp.experts.{x}.{hf}.weight" for x in range(s.experts)]
            plan.append(e(f"{b}.{gg}.weight", names, "matrix"))
        if s.shared_ffn:
            plan += [
                e(f"{b}.ffn_gate_inp_shexp.weight", [f"{p}.mlp.shared_expert_gate.weight"], "norm"),
                e(f"{b}.ffn_gate_shexp.weight", [f"{p}.mlp.shared_expert.gate_proj.weight"], "matrix"),
                e(f"{b}.ffn_up_shexp.weight", [f"{p}.mlp.shared_expert.up_proj.weight"], "matrix"),
                e(f"{b}.ffn_down_shexp.weight", [f"{p}.mlp.shared_expert.down_proj.weight"], "matrix"),
            ]
    plan += [
        e("output_norm.weight", ["model.norm.weight"], "norm"),
        e("output.weight", ["lm_head.weight"], "matrix"),
    ]
    return plan


def _deepseek_v2_plan(s: Shape, layers: int) -> list[Entry]:
    """llama.cpp's `deepseek2` layout (its converter's DeepseekV2Model).

    `kv_b_proj` [H·(nope + v), R] is split per head into ``attn_k_b``
    [H, R, nope] (each head's key rows, transposed) and ``attn_v_b``
    [H, v, R], the absorbed-MLA tensors current llama.cpp requires. RoPE
    needs no permutation: DeepSeek rotates adjacent pairs, llama.cpp's
    `deepseek2` rope type is NORM (adjacent pairs) too.
    """
    h, dn, dv, r = s.heads, s.qk_nope_dim, s.v_head_dim, s.kv_lora_rank

    def e(name, hf, kind, parts=None, shape=None):
        return Entry(name, tuple(hf), kind, parts, shape)

    def kv_b(st, name):
        return st.get(name).reshape(h, dn + dv, r)

    plan = [e("token_embd.weight", ["model.embed_tokens.weight"], "matrix")]
    for layer in range(layers):
        p, b, a = f"model.layers.{layer}", f"blk.{layer}", f"model.layers.{layer}.self_attn"
        kvb = f"{a}.kv_b_proj.weight"
        plan.append(e(f"{b}.attn_norm.weight", [f"{p}.input_layernorm.weight"], "norm"))
        if s.q_lora_rank:
            plan += [
                e(f"{b}.attn_q_a.weight", [f"{a}.q_a_proj.weight"], "matrix"),
                e(f"{b}.attn_q_a_norm.weight", [f"{a}.q_a_layernorm.weight"], "norm"),
                e(f"{b}.attn_q_b.weight", [f"{a}.q_b_proj.weight"], "matrix"),
            ]
        else:
            plan.append(e(f"{b}.attn_q.weight", [f"{a}.q_proj.weight"], "matrix"))
        plan += [
            e(f"{b}.attn_kv_a_mqa.weight", [f"{a}.kv_a_proj_with_mqa.weight"], "matrix"),
            e(f"{b}.attn_kv_a_norm.weight", [f"{a}.kv_a_layernorm.weight"], "norm"),
            e(
                f"{b}.attn_k_b.weight",
                [kvb],
                "matrix",
                lambda st, n=kvb: [kv_b(st, n)[i, :dn, :].T for i in range(h)],
                (h, r, dn),
            ),
            e(
                f"{b}.attn_v_b.weight",
                [kvb],
                "matrix",
                lambda st, n=kvb: [kv_b(st, n)[i, dn:, :] for i in range(h)],
                (h, dv, r),
            ),
            e(f"{b}.attn_output.weight", [f"{a}.o_proj.weight"], "matrix"),
            e(f"{b}.ffn_norm.weight", [f"{p}.post_attention_layernorm.weight"], "norm"),
        ]
        if layer < s.dense_layers:
            for gg in ("gate", "up", "down"):
                plan.append(e(f"{b}.ffn_{gg}.weight", [f"{p}.mlp.{gg}_proj.weight"], "matrix"))
            continue
        plan.append(e(f"{b}.ffn_gate_inp.weight", [f"{p}.mlp.gate.weight"], "norm"))
        if s.sigmoid_router:
            plan.append(e(f"{b}.exp_probs_b.bias", [f"{p}.mlp.gate.e_score_correction_bias"], "norm"))
        for gg in ("gate", "up", "down"):
            names = [f"{p}.mlp.experts.{x}.{gg}_proj.weight" for x in range(s.experts)]
            plan.append(e(f"{b}.ffn_{gg}_exps.weight", names, "matrix"))
        for gg in ("gate", "up", "down"):
            plan.append(
                e(f"{b}.ffn_{gg}_shexp.weight", [f"{p}.mlp.shared_experts.{gg}_proj.weight"], "matrix")
            )
    plan += [
        e("output_norm.weight", ["model.norm.weight"], "norm"),
        e("output.weight", ["lm_head.weight"], "matrix"),
    ]
    return plan


def _minimax_m2_plan(s: Shape, layers: int) -> list[Entry]:
    """llama.cpp's `minimax-m2` layout (its converter's MiniMaxM2Model): the
    Llama names, experts w1 / w3 / w2 stacked into gate / up / down, the
    correction bias as ``exp_probs_b.bias``. Rope rotates halves in both
    engines (llama.cpp's NEOX type), so q and k are not permuted."""

    def e(name, hf, kind):
        return Entry(name, tuple(hf), kind)

    plan = [e("token_embd.weight", ["model.embed_tokens.weight"], "matrix")]
    for layer in range(layers):
        p, b = f"model.layers.{layer}", f"blk.{layer}"
        a, m = f"{p}.self_attn", f"{p}.block_sparse_moe"
        plan += [
            e(f"{b}.attn_norm.weight", [f"{p}.input_layernorm.weight"], "norm"),
            e(f"{b}.attn_q.weight", [f"{a}.q_proj.weight"], "matrix"),
            e(f"{b}.attn_k.weight", [f"{a}.k_proj.weight"], "matrix"),
            e(f"{b}.attn_v.weight", [f"{a}.v_proj.weight"], "matrix"),
            e(f"{b}.attn_output.weight", [f"{a}.o_proj.weight"], "matrix"),
            e(f"{b}.attn_q_norm.weight", [f"{a}.q_norm.weight"], "norm"),
            e(f"{b}.attn_k_norm.weight", [f"{a}.k_norm.weight"], "norm"),
            e(f"{b}.ffn_norm.weight", [f"{p}.post_attention_layernorm.weight"], "norm"),
            e(f"{b}.ffn_gate_inp.weight", [f"{m}.gate.weight"], "norm"),
            e(f"{b}.exp_probs_b.bias", [f"{m}.e_score_correction_bias"], "norm"),
        ]
        for gg, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            names = [f"{m}.experts.{x}.{w}.weight" for x in range(s.experts)]
            plan.append(e(f"{b}.ffn_{gg}_exps.weight", names, "matrix"))
    plan += [
        e("output_norm.weight", ["model.norm.weight"], "norm"),
        e("output.weight", ["lm_head.weight"], "matrix"),
    ]
    return plan


def _nemotron_h_plan(s: Shape, layers: int) -> list[Entry]:
    """llama.cpp's `nemotron_h_moe` layout (its converter's NemotronHModel).

    - every block's one norm is ``attn_norm``; the block's kind is told by
      the per-layer `feed_forward_length` and `head_count_kv` (see
      `_add_metadata`), not by its tensors' names;
    - Mamba2: ``in_proj`` is ``ssm_in`` as it is (z | xBC | dt), the
      convolution ``[C, 1, K]`` ``ssm_conv1d`` ``[C, K]`` (f32, as ggml's
      convolution wants it), ``A_log`` ``ssm_a`` = ``-exp(A_log)`` and ``D``
      ``ssm_d``, both ``[H, 1]``, the gated norm's ``[I]`` ``ssm_norm``
      ``[G, I / G]`` (one row per group);
    - attention keeps q and k as they are: without RoPE the converter's
      q/k row permutation (within each head, the same for both) leaves q·k
      unchanged, so it is left out;
    - MoE: the ungated experts' ``up_proj`` / ``down_proj`` stacked into
      ``ffn_up_exps`` / ``ffn_down_exps``, the correction bias as
      ``exp_probs_b.bias``, the shared expert ``ffn_up_shexp`` /
      ``ffn_down_shexp``.

    One difference is left: colibri floors Mamba2's time step at
    `time_step_min` (0.001) in every step, llama.cpp never does. With these
    draws some time steps fall below it, which moves the logits by about 2e-3
    of their range over 32 tokens (F32 at small widths; 4e-5 with the floor
    set to 1e-9 in config.json).
    """
    i, g, h = s.mamba_heads * s.mamba_head_dim, s.mamba_groups, s.mamba_heads
    c = i + 2 * g * s.ssm_state

    def e(name, hf, kind, parts=None, shape=None):
        return Entry(name, tuple(hf), kind, parts, shape)

    def f32(st, n):
        return st.get(n).astype(np.float32)

    plan = [e("token_embd.weight", ["backbone.embeddings.weight"], "matrix")]
    for layer, kind in enumerate(s.blocks(layers)):
        p, b, m = f"backbone.layers.{layer}", f"blk.{layer}", f"backbone.layers.{layer}.mixer"
        plan.append(e(f"{b}.attn_norm.weight", [f"{p}.norm.weight"], "norm"))
        if kind == "M":
            cn, an, dn, nn = f"{m}.conv1d.weight", f"{m}.A_log", f"{m}.D", f"{m}.norm.weight"
            plan += [
                e(f"{b}.ssm_in.weight", [f"{m}.in_proj.weight"], "matrix"),
                e(
                    f"{b}.ssm_conv1d.weight",
                    [cn],
                    "norm",
                    lambda st, n=cn: f32(st, n)[:, 0, :],
                    (c, s.conv_kernel),
                ),
                e(f"{b}.ssm_conv1d.bias", [f"{m}.conv1d.bias"], "norm"),
                e(f"{b}.ssm_dt.bias", [f"{m}.dt_bias"], "norm"),
                e(f"{b}.ssm_a", [an], "norm", lambda st, n=an: -np.exp(f32(st, n)).reshape(h, 1), (h, 1)),
                e(f"{b}.ssm_d", [dn], "norm", lambda st, n=dn: f32(st, n).reshape(h, 1), (h, 1)),
                e(
                    f"{b}.ssm_norm.weight",
                    [nn],
                    "norm",
                    lambda st, n=nn: f32(st, n).reshape(g, i // g),
                    (g, i // g),
                ),
                e(f"{b}.ssm_out.weight", [f"{m}.out_proj.weight"], "matrix"),
            ]
        elif kind == "*":
            for gg, hf in (
                ("attn_q", "q_proj"),
                ("attn_k", "k_proj"),
                ("attn_v", "v_proj"),
                ("attn_output", "o_proj"),
            ):
                plan.append(e(f"{b}.{gg}.weight", [f"{m}.{hf}.weight"], "matrix"))
        else:
            plan += [
                e(f"{b}.ffn_gate_inp.weight", [f"{m}.gate.weight"], "norm"),
                e(f"{b}.exp_probs_b.bias", [f"{m}.gate.e_score_correction_bias"], "norm"),
            ]
            for gg in ("up", "down"):
                names = [f"{m}.experts.{x}.{gg}_proj.weight" for x in range(s.experts)]
                plan.append(e(f"{b}.ffn_{gg}_exps.weight", names, "matrix"))
            for gg in ("up", "down"):
                plan.append(
                    e(f"{b}.ffn_{gg}_shexp.weight", [f"{m}.shared_experts.{gg}_proj.weight"], "matrix")
                )
    plan += [
        e("output_norm.weight", ["backbone.norm_f.weight"], "norm"),
        e("output.weight", ["lm_head.weight"], "matrix"),
    ]
    return plan


def _gpt_oss_plan(s: Shape, layers: int) -> list[Entry]:
    """llama.cpp's `gpt-oss` layout (its converter's GptOssModel, bf16/f16 path).

    ``gate_up_proj`` [E, D, 2F] (x @ W) becomes ``ffn_gate_exps`` /
    ``ffn_up_exps`` [E, F, D] from its even / odd columns, transposed;
    ``down_proj`` [E, F, D] becomes ``ffn_down_exps`` [E, D, F]; the biases
    split the same way; ``sinks`` is ``attn_sinks.weight``.
    """
    d, f, ne = s.hidden, s.expert_ffn, s.experts

    def e(name, hf, kind, parts=None, shape=None):
        return Entry(name, tuple(hf), kind, parts, shape)

    plan = [e("token_embd.weight", ["model.embed_tokens.weight"], "matrix")]
    for layer in range(layers):
        p, b, a = f"model.layers.{layer}", f"blk.{layer}", f"model.layers.{layer}.self_attn"
        x = f"{p}.mlp.experts"
        gu, gub, dn, dnb = (
            f"{x}.gate_up_proj",
            f"{x}.gate_up_proj_bias",
            f"{x}.down_proj",
            f"{x}.down_proj_bias",
        )
        plan.append(e(f"{b}.attn_norm.weight", [f"{p}.input_layernorm.weight"], "norm"))
        for gg, hf in (
            ("attn_q", "q_proj"),
            ("attn_k", "k_proj"),
            ("attn_v", "v_proj"),
            ("attn_output", "o_proj"),
        ):
            plan.append(e(f"{b}.{gg}.weight", [f"{a}.{hf}.weight"], "matrix"))
            plan.append(e(f"{b}.{gg}.bias", [f"{a}.{hf}.bias"], "norm"))
        plan += [
            e(f"{b}.attn_sinks.weight", [f"{a}.sinks"], "norm"),
            e(f"{b}.post_attention_norm.weight", [f"{p}.post_attention_layernorm.weight"], "norm"),
            e(f"{b}.ffn_gate_inp.weight", [f"{p}.mlp.router.weight"], "norm"),
            e(f"{b}.ffn_gate_inp.bias", [f"{p}.mlp.router.bias"], "norm"),
            e(
                f"{b}.ffn_gate_exps.weight",
                [gu],
                "matrix",
                lambda st, n=gu: [st.get(n)[i][:, 0::2].T for i in range(ne)],
                (ne, f, d),
            ),
            e(f"{b}.ffn_gate_exps.bias", [gub], "norm", lambda st, n=gub: st.get(n)[:, 0::2], (ne, f)),
            e(
                f"{b}.ffn_up_exps.weight",
                [gu],
                "matrix",
                lambda st, n=gu: [st.get(n)[i][:, 1::2].T for i in range(ne)],
                (ne, f, d),
            ),
            e(f"{b}.ffn_up_exps.bias", [gub], "norm", lambda st, n=gub: st.get(n)[:, 1::2], (ne, f)),
            e(
                f"{b}.ffn_down_exps.weight",
                [dn],
                "matrix",
                lambda st, n=dn: [st.get(n)[i].T for i in range(ne)],
                (ne, d, f),
            ),
            e(f"{b}.ffn_down_exps.bias", [dnb], "norm"),
        ]
    plan += [
        e("output_norm.weight", ["model.norm.weight"], "norm"),
        e("output.weight", ["lm_head.weight"], "matrix"),
    ]
    return plan


def _deepseek_v4_plan(s: Shape, layers: int) -> list[Entry]:
    """llama.cpp's `deepseek4` layout (its converter's DeepseekV4Model): every
    tensor renamed only, none reshaped or permuted.

    - ``wo_a`` stays 2-D ``[og·ol, H·hd/og]``; llama.cpp views it as
      ``{H·hd/og, ol, og}`` itself (group-major rows, as DeepSeek stores it);
    - ``ape`` stays ``[ratio, c·hd]`` (llama.cpp's ``{c·hd, ratio}``);
    - rope needs no permutation: DeepSeek-V4 rotates adjacent pairs of the
      last ``qk_rope_head_dim`` values and llama.cpp's deepseek4 rope is
      the NORM (adjacent pairs) type;
    - ``tid2eid`` becomes int32 ``ffn_gate_tid2eid`` (hash layers), the
      correction bias ``exp_probs_b.bias`` (the other layers);
    - the hyper-connection tensors, sinks, ``ape``, the router and the
      indexer's ``weights_proj`` stay f32, as colibri's converter keeps them.
    """
    cfg = s.hf_config(layers)

    def e(name, hf, kind):
        return Entry(name, (hf,) if isinstance(hf, str) else tuple(hf), kind)

    plan = [
        e("token_embd.weight", "embed.weight", "matrix"),
        e("output_hc_fn.weight", "hc_head_fn", "norm"),
        e("output_hc_base.weight", "hc_head_base", "norm"),
        e("output_hc_scale.weight", "hc_head_scale", "norm"),
    ]
    for layer in range(layers):
        p, a, m, b = f"layers.{layer}", f"layers.{layer}.attn", f"layers.{layer}.ffn", f"blk.{layer}"
        ratio = cfg["compress_ratios"][layer]
        plan += [
            e(f"{b}.attn_norm.weight", f"{p}.attn_norm.weight", "norm"),
            e(f"{b}.attn_sinks.weight", f"{a}.attn_sink", "norm"),
            e(f"{b}.attn_q_a.weight", f"{a}.wq_a.weight", "matrix"),
            e(f"{b}.attn_q_a_norm.weight", f"{a}.q_norm.weight", "norm"),
            e(f"{b}.attn_q_b.weight", f"{a}.wq_b.weight", "matrix"),
            e(f"{b}.attn_kv.weight", f"{a}.wkv.weight", "matrix"),
            e(f"{b}.attn_kv_a_norm.weight", f"{a}.kv_norm.weight", "norm"),
            e(f"{b}.attn_output_a.weight", f"{a}.wo_a.weight", "matrix"),
            e(f"{b}.attn_output_b.weight", f"{a}.wo_b.weight", "matrix"),
        ]
        for hc in ("attn", "ffn"):
            for x in ("fn", "base", "scale"):
                plan.append(e(f"{b}.hc_{hc}_{x}.weight", f"{p}.hc_{hc}_{x}", "norm"))
        if ratio:
            c = f"{a}.compressor"
            plan += [
                e(f"{b}.attn_compressor_kv.weight", f"{c}.wkv.weight", "matrix"),
                e(f"{b}.attn_compressor_gate.weight", f"{c}.wgate.weight", "matrix"),
                e(f"{b}.attn_compressor_ape.weight", f"{c}.ape", "norm"),
                e(f"{b}.attn_compressor_norm.weight", f"{c}.norm.weight", "norm"),
            ]
        if ratio == 4:
            x = f"{a}.indexer"
            plan += [
                e(f"{b}.indexer.proj.weight", f"{x}.weights_proj.weight", "norm"),
                e(f"{b}.indexer.attn_q_b.weight", f"{x}.wq_b.weight", "matrix"),
                e(f"{b}.indexer_compressor_kv.weight", f"{x}.compressor.wkv.weight", "matrix"),
                e(f"{b}.indexer_compressor_gate.weight", f"{x}.compressor.wgate.weight", "matrix"),
                e(f"{b}.indexer_compressor_ape.weight", f"{x}.compressor.ape", "norm"),
                e(f"{b}.indexer_compressor_norm.weight", f"{x}.compressor.norm.weight", "norm"),
            ]
        plan += [
            e(f"{b}.ffn_norm.weight", f"{p}.ffn_norm.weight", "norm"),
            e(f"{b}.ffn_gate_inp.weight", f"{m}.gate.weight", "norm"),
        ]
        if layer < cfg["num_hash_layers"]:
            plan.append(e(f"{b}.ffn_gate_tid2eid.weight", f"{m}.gate.tid2eid", "int32"))
        else:
            plan.append(e(f"{b}.exp_probs_b.bias", f"{m}.gate.bias", "norm"))
        for gg, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            names = [f"{m}.experts.{x}.{w}.weight" for x in range(s.experts)]
            plan.append(e(f"{b}.ffn_{gg}_exps.weight", names, "matrix"))
        for gg, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            plan.append(e(f"{b}.ffn_{gg}_shexp.weight", f"{m}.shared_experts.{w}.weight", "matrix"))
    plan += [
        e("output_norm.weight", "norm.weight", "norm"),
        e("output.weight", "head.weight", "matrix"),
    ]
    return plan


def tiled(x: np.ndarray, groups: int, per_group: int, width: int, axis: int = 0) -> np.ndarray:
    """Value heads from grouped order (the ``per_group`` value heads of key
    head 0, then of key head 1, ...) to tiled order (value head 0 of every key
    head, then value head 1, ...), each head ``width`` entries along ``axis``."""
    shape = x.shape
    split = shape[:axis] + (groups, per_group, width) + shape[axis + 1 :]
    return np.swapaxes(x.reshape(split), axis, axis + 1).reshape(shape)


def _qwen35moe_plan(s: Shape, layers: int) -> list[Entry]:
    """llama.cpp's `qwen35moe` layout (its converter's Qwen3_5MoeTextModel).

    - every RMSNorm weight of the residual stream and of q/k is stored as
      ``1 + w`` (the Hub stores the zero-centred ``w``); the linear layers'
      gated norm (``ssm_norm``) as it is;
    - ``A_log`` becomes ``ssm_a`` = ``-exp(A_log)``, ``dt_bias`` ``ssm_dt.bias``,
      the convolution ``[C, 1, K]`` ``ssm_conv1d`` ``[C, K]`` (f32);
    - value heads go from the Hub's grouped order to tiled order (see
      `tiled`), so that ggml can repeat the key heads by broadcasting: the v
      rows of ``in_proj_qkv`` (``attn_qkv``), ``in_proj_z`` (``attn_gate``),
      ``in_proj_b`` / ``in_proj_a`` (``ssm_beta`` / ``ssm_alpha``), ``A_log``,
      ``dt_bias``, the v channels of the convolution and the columns of
      ``out_proj`` (``ssm_out``). The state and outputs are permuted the same
      way, so the model computes the same function;
    - full attention keeps ``q_proj``'s per-head [query; gate] rows as they
      are (``attn_q``); the shared expert's gate ``[1, D]`` becomes ``[D]``.
    """
    d, kd = s.hidden, s.linear_k_heads * s.linear_k_dim
    hk, r, dv = s.linear_k_heads, s.linear_v_heads // s.linear_k_heads, s.linear_v_dim
    vd, hv, c = s.linear_v_heads * dv, s.linear_v_heads, 2 * kd + s.linear_v_heads * dv

    def e(name, hf, kind, parts=None, shape=None):
        return Entry(name, tuple(hf), kind, parts, shape)

    def plus_one(st, n):
        return st.get(n).astype(np.float32) + np.float32(1.0)

    def qkv(st, n):
        w = st.get(n)
        return [w[: 2 * kd], tiled(w[2 * kd :], hk, r, dv)]

    def conv(st, n):
        w = st.get(n)[:, 0, :].astype(np.float32)
        return np.concatenate([w[: 2 * kd], tiled(w[2 * kd :], hk, r, dv)])

    def a(st, n):
        return -np.exp(tiled(st.get(n).astype(np.float32), hk, r, 1))

    plan = [e("token_embd.weight", ["model.embed_tokens.weight"], "matrix")]
    for layer, kind in enumerate(s.layer_types(layers)):
        p, b = f"model.layers.{layer}", f"blk.{layer}"
        n = f"{p}.input_layernorm.weight"
        plan.append(e(f"{b}.attn_norm.weight", [n], "norm", lambda st, n=n: plus_one(st, n)))
        if kind == "linear_attention":
            la = f"{p}.linear_attn"
            qn, zn, bn, an = (f"{la}.in_proj_{x}.weight" for x in ("qkv", "z", "b", "a"))
            cn, aln, dtn, on = f"{la}.conv1d.weight", f"{la}.A_log", f"{la}.dt_bias", f"{la}.out_proj.weight"
            plan += [
                e(f"{b}.attn_qkv.weight", [qn], "matrix", lambda st, n=qn: qkv(st, n), (c, d)),
                e(
                    f"{b}.attn_gate.weight",
                    [zn],
                    "matrix",
                    lambda st, n=zn: [tiled(st.get(n), hk, r, dv)],
                    (vd, d),
                ),
                e(f"{b}.ssm_conv1d.weight", [cn], "norm", lambda st, n=cn: conv(st, n), (c, s.conv_kernel)),
                e(
                    f"{b}.ssm_dt.bias",
                    [dtn],
                    "norm",
                    lambda st, n=dtn: tiled(st.get(n).astype(np.float32), hk, r, 1),
                    (hv,),
                ),
                e(f"{b}.ssm_a", [aln], "norm", lambda st, n=aln: a(st, n), (hv,)),
                e(
                    f"{b}.ssm_beta.weight",
                    [bn],
                    "matrix",
                    lambda st, n=bn: [tiled(st.get(n), hk, r, 1)],
                    (hv, d),
                ),
                e(
                    f"{b}.ssm_alpha.weight",
                    [an],
                    "matrix",
                    lambda st, n=an: [tiled(st.get(n), hk, r, 1)],
                    (hv, d),
                ),
                e(f"{b}.ssm_norm.weight", [f"{la}.norm.weight"], "norm"),
                e(
                    f"{b}.ssm_out.weight",
                    [on],
                    "matrix",
                    lambda st, n=on: [tiled(st.get(n), hk, r, dv, axis=1)],
                    (d, vd),
                ),
            ]
        else:
            sa = f"{p}.self_attn"
            plan += [
                e(f"{b}.attn_q.weight", [f"{sa}.q_proj.weight"], "matrix"),
                e(f"{b}.attn_k.weight", [f"{sa}.k_proj.weight"], "matrix"),
                e(f"{b}.attn_v.weight", [f"{sa}.v_proj.weight"], "matrix"),
                e(f"{b}.attn_output.weight", [f"{sa}.o_proj.weight"], "matrix"),
            ]
            for x in ("q", "k"):
                n = f"{sa}.{x}_norm.weight"
                plan.append(e(f"{b}.attn_{x}_norm.weight", [n], "norm", lambda st, n=n: plus_one(st, n)))
        n = f"{p}.post_attention_layernorm.weight"
        sg = f"{p}.mlp.shared_expert_gate.weight"
        plan += [
            e(f"{b}.post_attention_norm.weight", [n], "norm", lambda st, n=n: plus_one(st, n)),
            e(f"{b}.ffn_gate_inp.weight", [f"{p}.mlp.gate.weight"], "norm"),
        ]
        for gg, hf in (
            ("ffn_gate_exps", "gate_proj"),
            ("ffn_up_exps", "up_proj"),
            ("ffn_down_exps", "down_proj"),
        ):
            names = [f"{p}.mlp.experts.{x}.{hf}.weight" for x in range(s.experts)]
            plan.append(e(f"{b}.{gg}.weight", names, "matrix"))
        plan += [
            e(f"{b}.ffn_gate_inp_shexp.weight", [sg], "norm", lambda st, n=sg: st.get(n).reshape(d), (d,)),
            e(f"{b}.ffn_gate_shexp.weight", [f"{p}.mlp.shared_expert.gate_proj.weight"], "matrix"),
            e(f"{b}.ffn_up_shexp.weight", [f"{p}.mlp.shared_expert.up_proj.weight"], "matrix"),
            e(f"{b}.ffn_down_shexp.weight", [f"{p}.mlp.shared_expert.down_proj.weight"], "matrix"),
        ]
    plan += [
        e("output_norm.weight", ["model.norm.weight"], "norm", lambda st: plus_one(st, "model.norm.weight")),
        e("output.weight", ["lm_head.weight"], "matrix"),
    ]
    return plan


def _qtype(name: str):
    import gguf

    return gguf.GGMLQuantizationType[name]


def tensor_type(gtype: str, name: str) -> str:
    """The GGUF type of one matrix in a file of `gtype` ("MXFP4": experts only)."""
    if gtype == "MXFP4":
        return "MXFP4" if "_exps." in name else "Q4_0"
    return gtype


def _encode(x16: np.ndarray, gtype: str) -> np.ndarray:
    """f16 rows -> bytes of `gtype` (via the gguf package's quantiser)."""
    import gguf

    if gtype == "F16":
        return x16.view(np.uint8)
    x = x16.astype(np.float32)
    if gtype == "F32":
        return x.view(np.uint8)
    return gguf.quants.quantize(x, _qtype(gtype))


def _row_bytes(cols: int, gtype: str) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[_qtype(gtype)]
    return cols // block * size


def _add_metadata(w, s: Shape, layers: int, cfg: dict) -> None:
    """The architecture's GGUF keys, as llama.cpp's converter writes them."""
    import gguf

    w.add_context_length(s.max_pos)
    w.add_embedding_length(s.hidden)
    w.add_block_count(layers)
    w.add_head_count(s.heads)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.top_k)
    w.add_vocab_size(s.vocab)
    if s.model_type in ("deepseek_v2", "glm4_moe_lite"):
        # MLA is stored as MQA over the latent: one kv head, keys of
        # kv_lora_rank + rope, values of kv_lora_rank; the MLA head sizes
        # (nope + rope, v) separately.
        w.add_feed_forward_length(s.dense_ffn)
        w.add_head_count_kv(1)
        w.add_leading_dense_block_count(min(s.dense_layers, layers))
        # llama.cpp reads q_lora_rank unless the layer count is a known
        # "lite" one (26 or 27 layers); 0 means q_proj, no q_a/q_b.
        w.add_q_lora_rank(s.q_lora_rank)
        w.add_kv_lora_rank(s.kv_lora_rank)
        w.add_key_length(s.kv_lora_rank + s.qk_rope_dim)
        w.add_value_length(s.kv_lora_rank)
        w.add_key_length_mla(s.qk_nope_dim + s.qk_rope_dim)
        w.add_value_length_mla(s.v_head_dim)
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_expert_shared_count(s.shared_experts)
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if s.sigmoid_router:
            # GLM-4.7-Flash: as the converter writes it from scoring_func,
            # norm_topk_prob, n_group and topk_group.
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            w.add_expert_weights_norm(s.norm_topk_prob)
            w.add_expert_group_count(cfg["n_group"])
            w.add_expert_group_used_count(cfg["topk_group"])
        else:
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        w.add_rope_dimension_count(s.qk_rope_dim)
        return
    if s.model_type == "minimax_m2":
        # As the converter's MiniMaxM2Model writes them: the expert width is
        # intermediate_size, rope on rotary_dim of head_dim, sigmoid gating.
        w.add_feed_forward_length(s.expert_ffn)
        w.add_head_count_kv(s.kv_heads)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_rope_dimension_count(cfg["rotary_dim"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        return
    if s.model_type == "nemotron_h":
        _nemotron_h_metadata(w, s, layers, cfg)
        return
    if s.model_type == "qwen3_5_moe_text":
        # As llama.cpp's converter (Qwen3_5MoeTextModel) writes them; the
        # layer pattern comes from full_attention_interval.
        w.add_head_count_kv(s.kv_heads)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_expert_shared_feed_forward_length(s.shared_ffn)
        w.add_ssm_conv_kernel(s.conv_kernel)
        w.add_ssm_state_size(s.linear_k_dim)
        w.add_ssm_group_count(s.linear_k_heads)
        w.add_ssm_time_step_rank(s.linear_v_heads)
        w.add_ssm_inner_size(s.linear_v_dim * s.linear_v_heads)
        w.add_full_attention_interval(s.full_every)
        w.add_rope_dimension_count(int(s.head_dim * s.partial_rotary))
        w.add_rope_dimension_sections(cfg["rope_parameters"]["mrope_section"] + [0])
        return
    if s.model_type == "deepseek_v4":
        _add_deepseek4_metadata(w, s, layers, cfg)
        return
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count_kv(s.kv_heads)
    if s.model_type == "gpt_oss":
        rs = cfg["rope_scaling"]
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_sliding_window(s.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
        return
    if s.model_type == "qwen3_moe":
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if s.model_type == "qwen2_moe":
        w.add_expert_feed_forward_length(s.expert_ffn)
        w.add_expert_shared_feed_forward_length(s.shared_ffn)


def _nemotron_h_metadata(w, s: Shape, layers: int, cfg: dict) -> None:
    """`nemotron_h_moe`'s keys, as llama.cpp's converter (NemotronHModel)
    writes them. llama.cpp reads each block's kind from two per-layer arrays:
    a block with `feed_forward_length` > 0 is MoE, else one with
    `head_count_kv` > 0 is attention, else Mamba2. `layer_norm_epsilon` is
    required by the loader (its multi-token-prediction head's LayerNorm)."""
    blocks = s.blocks(layers)
    w.add_feed_forward_length([s.expert_ffn if k == "E" else 0 for k in blocks])
    w.add_head_count_kv([s.kv_heads if k == "*" else 0 for k in blocks])
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_eps(cfg["layer_norm_epsilon"])
    w.add_ssm_conv_kernel(s.conv_kernel)
    w.add_ssm_inner_size(s.mamba_heads * s.mamba_head_dim)
    w.add_ssm_state_size(s.ssm_state)
    w.add_ssm_time_step_rank(s.mamba_heads)
    w.add_ssm_group_count(s.mamba_groups)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_expert_shared_feed_forward_length(s.shared_ffn)
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_norm(s.norm_topk_prob)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])


def _add_deepseek4_metadata(w, s: Shape, layers: int, cfg: dict) -> None:
    """llama.cpp's `deepseek4` keys, as its converter's DeepseekV4Model writes
    them. The installed gguf package predates the arch, so its own keys are
    written by their full names."""
    import gguf

    arch = s.gguf_arch
    rs = cfg["rope_scaling"]
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.qk_rope_dim)
    # YaRN applies on the pooled layers only (llama.cpp and transformers alike).
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rs["factor"])
    w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
    w.add_q_lora_rank(s.q_lora_rank)
    w.add_sliding_window(s.sliding_window)
    w.add_expert_feed_forward_length(s.expert_ffn)
    w.add_expert_shared_count(s.shared_experts)
    w.add_expert_weights_scale(s.routed_scale)
    w.add_expert_weights_norm(s.norm_topk_prob)
    w.add_swiglu_clamp_exp([cfg["swiglu_limit"]] * layers)
    w.add_swiglu_clamp_shexp([cfg["swiglu_limit"]] * layers)
    w.add_indexer_head_count(s.index_heads)
    w.add_indexer_key_length(s.index_dim)
    w.add_indexer_top_k(s.index_topk)
    w.add_uint32(f"{arch}.attention.output_group_count", cfg["o_groups"])
    w.add_uint32(f"{arch}.attention.output_lora_rank", cfg["o_lora_rank"])
    # Python ints: an INT32 array, as the converter writes it.
    w.add_array(f"{arch}.attention.compress_ratios", list(cfg["compress_ratios"]))
    w.add_float32(f"{arch}.attention.compress_rope_freq_base", cfg["compress_rope_theta"])
    w.add_uint32(f"{arch}.hyper_connection.count", cfg["hc_mult"])
    w.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", cfg["hc_sinkhorn_iters"])
    w.add_float32(f"{arch}.hyper_connection.epsilon", cfg["hc_eps"])
    w.add_uint32(f"{arch}.hash_layer_count", cfg["num_hash_layers"])
    w.add_uint32(f"{arch}.embedding_length_out", s.hidden * cfg["hc_mult"])
    # 4: sqrt(softplus), which the deepseek4 loader insists on (the installed
    # package's ExpertGatingFuncType has no member for it).
    w.add_uint32(f"{arch}.expert_gating_func", 4)


def write_gguf(s: Shape, layers: int, st: SafetensorsFile, gtype: str, path: Path, log) -> None:
    import gguf

    cfg = s.hf_config(layers)
    w = gguf.GGUFWriter(None, s.gguf_arch)
    arch = s.gguf_arch
    w.add_name(f"random {s.name} {layers}-layer ({gtype})")
    _add_metadata(w, s, layers, cfg)
    ftype = {
        "F32": gguf.LlamaFileType.ALL_F32,
        "F16": gguf.LlamaFileType.MOSTLY_F16,
        "BF16": gguf.LlamaFileType.MOSTLY_BF16,
        "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
        "MXFP4": gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
    }[gtype]
    w.add_file_type(ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    # A placeholder vocabulary in SentencePiece form (the benches feed token
    # ids; llama-server turns every generated id into text, so each must
    # exist): <unk> <s> </s>, the 256 byte tokens, then "t<id>".
    w.add_tokenizer_model("llama")
    names = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    names += [f"t{i}" for i in range(len(names), s.vocab)]
    w.add_token_list(names)
    w.add_token_scores([0.0] * s.vocab)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (s.vocab - 259))  # unknown, control, byte, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    assert f"{arch}.vocab_size" in w.kv_data[0]

    plan = gguf_plan(s, layers)
    for ent in plan:
        if ent.shape is not None:
            shape = list(ent.shape)
        else:
            first = st.header[ent.hf[0]]["shape"]
            shape = ([len(ent.hf)] if len(ent.hf) > 1 else []) + list(first)
        if ent.kind == "norm":
            w.add_tensor_info(ent.name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        elif ent.kind == "int32":
            w.add_tensor_info(ent.name, shape, np.dtype(np.int32), int(np.prod(shape)) * 4)
        else:
            tt = tensor_type(gtype, ent.name)
            nbytes = int(np.prod(shape[:-1])) * _row_bytes(shape[-1], tt)
            w.add_tensor_info(ent.name, shape, np.dtype(np.float16), nbytes, raw_dtype=_qtype(tt))
    tmp = path.with_suffix(".tmp")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    chunk_rows = 4096
    for i, ent in enumerate(plan):
        if ent.kind in ("norm", "int32"):
            x = ent.parts(st) if ent.parts else st.get(ent.hf[0])
            dtype = np.float32 if ent.kind == "norm" else np.int32
            w.write_tensor_data(np.ascontiguousarray(x, dtype=dtype))
            continue
        tt = tensor_type(gtype, ent.name)
        parts = ent.parts(st) if ent.parts else [st.get(n) for n in ent.hf]
        cols = parts[0].shape[1]
        rb = _row_bytes(cols, tt)
        out = np.empty((sum(len(part) for part in parts), rb), dtype=np.uint8)
        r = 0
        for part in parts:
            for a in range(0, len(part), chunk_rows):
                blk = np.ascontiguousarray(part[a : a + chunk_rows])
                out[r : r + len(blk)] = _encode(blk, tt).reshape(len(blk), rb)
                r += len(blk)
        w.write_tensor_data(out)
        if i % 10 == 0:
            log(f"  gguf {gtype} {i}/{len(plan)} tensors, {time.time() - t0:.0f}s")
    w.close()
    os.replace(tmp, path)


# ---------------------------------------------------------------- driver


def gguf_path(s: Shape, layers: int, gtype: str, root: Path = CACHE) -> Path:
    return model_dir(s, layers, root) / "gguf" / f"model-{gtype}.gguf"


def hf_dir(s: Shape, layers: int, root: Path = CACHE, mtp: bool = False) -> Path:
    return model_dir(s, layers, root, mtp) / "hf"


def make_mtp(s: Shape, layers: int, root: Path, force: bool, log, base: Path | None = None) -> None:
    """The checkpoint with a multi-token-prediction layer, as two shards and
    an index: the model's own tensors (hard-linked from `base`, a folder this
    script wrote for the same shape and layers without --mtp, when given)
    and the layer's."""
    hdir = hf_dir(s, layers, root, mtp=True)
    if force and hdir.exists():
        shutil.rmtree(hdir)
    index_path = hdir / "model.safetensors.index.json"
    if index_path.exists():
        return
    hdir.mkdir(parents=True, exist_ok=True)
    cfg = s.hf_config(layers)
    shards = {"model-00001-of-00002.safetensors": hf_tensors(s, layers)}
    shards["model-00002-of-00002.safetensors"] = mtp_tensors(s, layers)
    main_path = hdir / "model-00001-of-00002.safetensors"
    if base is not None:
        base_cfg = json.loads((base / "config.json").read_text())
        if base_cfg != cfg:
            raise SystemExit(f"{base}: its config.json is not the {s.name} l{layers} one this script writes")
        if not main_path.exists():
            try:
                os.link(base / "model.safetensors", main_path)
            except OSError:
                main_path.symlink_to((base / "model.safetensors").resolve())
        log(f"{s.name} l{layers}: the model's tensors linked from {base}")
    elif not main_path.exists():
        log(f"{s.name} l{layers}: writing {main_path}")
        write_safetensors(s, layers, main_path, log)
    log(f"{s.name} l{layers}: writing the MTP layer")
    write_safetensors(
        s, layers, hdir / "model-00002-of-00002.safetensors", log, shards["model-00002-of-00002.safetensors"]
    )
    cfg["mtp_num_hidden_layers"] = 1
    (hdir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (hdir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    total = 2 * param_count(s, layers, mtp=True)
    weight_map = {t.name: f for f, ts in shards.items() for t in ts}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def make(
    s: Shape, layers: int, gguf_types: list[str], root: Path, force: bool, log, no_checkpoint: bool = False
) -> None:
    """The checkpoint (unless `no_checkpoint`) and the GGUF files of `gguf_types`
    (from the checkpoint when it exists, else from the drawn values: the same bits)."""
    hdir = hf_dir(s, layers, root)
    st_path = hdir / "model.safetensors"
    if force and hdir.exists() and not no_checkpoint:
        shutil.rmtree(hdir)
    if not st_path.exists() and not no_checkpoint:
        hdir.mkdir(parents=True, exist_ok=True)
        cfg = s.hf_config(layers)
        (hdir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {"eos_token_id": cfg["eos_token_id"], "do_sample": False}
        (hdir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        log(f"{s.name} l{layers}: writing {st_path}")
        t0 = time.time()
        write_safetensors(s, layers, st_path, log)
        log(f"{s.name} l{layers}: safetensors done in {time.time() - t0:.0f}s")
    st = SafetensorsFile(st_path) if st_path.exists() else DrawnCheckpoint(s, layers)
    for gtype in gguf_types:
        path = gguf_path(s, layers, gtype, root)
        if path.exists() and not force:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        log(f"{s.name} l{layers}: writing {path}")
        t0 = time.time()
        write_gguf(s, layers, st, gtype, path, log)
        log(f"{s.name} l{layers}: {gtype} done in {time.time() - t0:.0f}s")


def sizes(shapes: list[Shape], layers: int, gguf_types: list[str], mtp: bool = False) -> str:
    lines = []
    for s in shapes:
        n = param_count(s, layers, mtp)
        extra = " and an MTP layer" if mtp else ""
        parts = [
            f"{s.name} with {layers} layers{extra}: {n / 1e9:.2f} B parameters; "
            f"f16 checkpoint {2 * n / 1e9:.1f} GB"
        ]
        for g in gguf_types:
            if g in ("F16", "BF16"):
                b = 2.0
            elif g == "F32":
                b = 4.0
            else:
                b = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32, "MXFP4": 17 / 32}[g]
            parts.append(f"{g} ~{n * b / 1e9:.1f} GB")
        lines.append(", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write random-weight MoE checkpoints of real widths (HF safetensors + GGUF).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=sizes(list(SHAPES.values()), 4, ["F16", "Q8_0", "Q4_0"]),
    )
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    ap.add_argument(
        "--gguf-types",
        default="F16,Q8_0,Q4_0",
        help=f"comma list of GGUF types to write, from {', '.join(GGUF_TYPES)} (empty: none)",
    )
    ap.add_argument("--cache", type=Path, default=CACHE, help=f"output root (default {CACHE})")
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    ap.add_argument("--sizes", action="store_true", help="print the sizes and exit")
    ap.add_argument(
        "--no-checkpoint",
        action="store_true",
        help="write the GGUF files from the drawn values when the safetensors checkpoint is absent, "
        "without writing it (the same bits; for a disk too small for both: colibri convert needs "
        "the checkpoint, so convert first, delete it, then write the GGUF)",
    )
    ap.add_argument(
        "--mtp",
        action="store_true",
        help="add a multi-token-prediction layer (Qwen3-Next's mtp.* layout; shapes "
        + ", ".join(MTP_SHAPES)
        + "); writes <shape>-l<layers>-mtp/hf/ and no GGUF",
    )
    ap.add_argument(
        "--base",
        type=Path,
        help="with --mtp: the hf/ folder of the same shape and layers without it, whose "
        "model.safetensors is hard-linked instead of written again",
    )
    args = ap.parse_args(argv)

    shapes = [SHAPES[n] for n in args.shapes.split(",") if n]
    types = [t.upper() for t in args.gguf_types.split(",") if t]
    for t in types:
        if t not in GGUF_TYPES:
            ap.error(f"unknown GGUF type {t}")
    if args.base is not None and not args.mtp:
        ap.error("--base goes with --mtp")
    if args.mtp:
        if any(s.name not in MTP_SHAPES for s in shapes):
            ap.error(f"--mtp is for the shapes {', '.join(MTP_SHAPES)}")
        if args.base is not None and len(shapes) != 1:
            ap.error("--base names one shape's folder")
        types = []
    if args.sizes:
        print(sizes(shapes, args.layers, types, args.mtp))
        return 0

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    for s in shapes:
        if args.mtp:
            make_mtp(s, args.layers, args.cache, args.force, log, args.base)
        else:
            make(s, args.layers, types, args.cache, args.force, log, args.no_checkpoint)
    print(sizes(shapes, args.layers, types, args.mtp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
