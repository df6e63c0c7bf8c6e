"""The tiny Hugging Face configurations the HF tests share, and the plan each gets (what stays whole, what is
gathered), pinned by tests/test_hf_models.py. Kept apart from the tests (no pytest, no expecttest) so that
tests/test_cuda.py imports them on a machine that has only torch, transformers and pytest (the GPU image)."""

from __future__ import annotations

import transformers as T

_IDS = dict(vocab_size=96, num_hidden_layers=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama_like(cls, **extra):
    return cls(**{"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                  **_IDS, **extra})


CONFIGS = {
    "llama": lambda: _llama_like(T.LlamaConfig),
    "mistral": lambda: _llama_like(T.MistralConfig),
    "qwen2": lambda: _llama_like(T.Qwen2Config),
    "qwen3": lambda: _llama_like(T.Qwen3Config, head_dim=16),  # q_norm / k_norm over head_dim
    "gemma2": lambda: _llama_like(T.Gemma2Config, head_dim=16),
    "phi": lambda: T.PhiConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, **_IDS),
    "phi3": lambda: _llama_like(T.Phi3Config),  # fused qkv_proj, fused gate_up_proj
    "stablelm": lambda: _llama_like(T.StableLmConfig, qk_layernorm=True),  # a LayerNorm per head
    "starcoder2": lambda: _llama_like(T.Starcoder2Config),
    "olmo": lambda: _llama_like(T.OlmoConfig),
    "olmo2": lambda: _llama_like(T.Olmo2Config),  # q_norm / k_norm over the whole projection: an all_reduce
    "gpt2": lambda: T.GPT2Config(n_embd=64, n_head=4, n_layer=1, vocab_size=96, bos_token_id=1, eos_token_id=2),
    "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, **_IDS),
    "gptj": lambda: T.GPTJConfig(n_embd=64, n_head=4, n_layer=1, rotary_dim=8, vocab_size=96, bos_token_id=1,
                                 eos_token_id=2),
    "opt": lambda: T.OPTConfig(hidden_size=64, ffn_dim=128, num_attention_heads=4, word_embed_proj_dim=64, **_IDS),
    "bloom": lambda: T.BloomConfig(hidden_size=64, n_head=4, n_layer=1, vocab_size=96, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0),  # ALiBi through baddbmm
    "falcon": lambda: T.FalconConfig(hidden_size=64, num_attention_heads=4, new_decoder_architecture=True,
                                     num_kv_heads=2, **_IDS),  # qkv grouped per KV head, qkv[..., [-2]]
    # 4 query heads a KV group: at 4 ranks each group is cut into its components (its query heads dealt
    # out, one to each rank; its k and v held whole), where "falcon" (2 a group) stays whole
    "falcon_groups": lambda: T.FalconConfig(hidden_size=64, num_attention_heads=8, new_decoder_architecture=True,
                                            num_kv_heads=2, **_IDS),
    # Falcon-7B's multi-query form: [q heads | k | v] viewed into heads, k and v taken by list indexing
    "falcon_mqa": lambda: T.FalconConfig(hidden_size=64, num_attention_heads=4, new_decoder_architecture=False,
                                         multi_query=True, **_IDS),
    # Differential attention: V's K/V heads halved and repeated, head h paired with head h + H/2 (chunk of
    # the head dim), an RMSNorm over each pair's 2 * head_dim. 8 heads and 4 K/V heads: at 2 ranks q, k
    # and v are each cut in two halves of heads; at 4 ranks k and v (2 heads a half) are held whole.
    "diffllama": lambda: _llama_like(T.DiffLlamaConfig, num_attention_heads=8, num_key_value_heads=4),
    # Mixture-of-experts (transformers' default grouped_mm experts); Qwen2-MoE adds a shared expert and its gate
    "mixtral": lambda: _llama_like(T.MixtralConfig, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: _llama_like(T.Qwen2MoeConfig, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                     num_experts=4, num_experts_per_tok=2),
}

KV_WHOLE_AT_4 = {"k_proj", "v_proj"}
TIED = "all_gather (before output)"
# arch -> world -> (layers kept whole, {layer: gather}) by the last part of their FQN
EXPECTED = {
    "llama": {2: ({"lm_head"}, {}), 4: ({"lm_head"} | KV_WHOLE_AT_4, {})},
    "mistral": {2: ({"lm_head"}, {})},
    "qwen2": {2: ({"lm_head"}, {})},
    "qwen3": {2: ({"lm_head"}, {}), 4: ({"lm_head"} | KV_WHOLE_AT_4, {})},
    "gemma2": {2: (set(), {"embed_tokens": TIED}), 4: (KV_WHOLE_AT_4, {"embed_tokens": TIED})},
    "phi": {2: ({"lm_head"}, {})},
    "phi3": {2: ({"lm_head"}, {}), 4: ({"lm_head"}, {})},  # at 4 ranks k and v are held whole inside qkv_proj
    "stablelm": {2: ({"lm_head"}, {}), 4: ({"lm_head"} | KV_WHOLE_AT_4, {})},
    "starcoder2": {2: (set(), {"embed_tokens": TIED})},
    "olmo": {2: ({"lm_head"}, {})},
    "olmo2": {2: ({"lm_head"}, {}), 4: ({"lm_head"} | KV_WHOLE_AT_4, {})},  # (the norms: no gather)
    "gpt2": {2: (set(), {"wte": TIED}), 4: (set(), {"wte": TIED})},
    "gpt_neox": {2: ({"lm_head"}, {})},
    "gptj": {2: ({"lm_head"}, {})},
    "opt": {2: (set(), {"embed_tokens": TIED})},
    "bloom": {2: (set(), {"word_embeddings": TIED}), 4: (set(), {"word_embeddings": TIED})},
    "falcon": {2: (set(), {"word_embeddings": TIED}),
               4: ({"query_key_value", "dense"}, {"word_embeddings": TIED})},
    # 2 query heads a group on 4 ranks: no cut deals every rank a query head of every group (holding one
    # group per pair of ranks needs a cut on two dims, groups and heads in a group: not expressible yet)
    "falcon_groups": {2: (set(), {"word_embeddings": TIED}), 4: (set(), {"word_embeddings": TIED})},
    "falcon_mqa": {2: (set(), {"word_embeddings": TIED}), 4: (set(), {"word_embeddings": TIED})},
    # Head h is paired with head h + H/2 and V's two halves of K/V heads are repeated: q, k and v are each
    # cut as two components of heads (rank r holds its block of either half, as of a fused [q | k | v]),
    # so each rank runs the attention and the RMSNorm on its own head pairs and o_proj reads them rowwise:
    # Llama's 2 all_reduces a layer (counted below). At 4 ranks k and v, with 2 K/V heads a half, are
    # held whole and narrowed to each rank's query heads, as Llama's 2 K/V heads are.
    "diffllama": {2: ({"lm_head"}, {}), 4: ({"lm_head"} | KV_WHOLE_AT_4, {})},
    # the router ("gate", 4 x 64) stays whole; every expert's gate_up_proj / down_proj is cut
    "mixtral": {2: ({"lm_head", "gate"}, {}), 4: ({"lm_head", "gate"} | KV_WHOLE_AT_4, {})},
    "qwen2_moe": {2: ({"lm_head", "gate", "shared_expert_gate"}, {})},
}
