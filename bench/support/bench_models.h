// Weight layouts with the tensor structure of real models, built from their public configs (no
// downloads): names, shapes and order as in the Hugging Face checkpoints, all bf16.
//
//   per layer: q, k, v (+ bias for Qwen), o, gate, up, down, input and post-attention norms;
//   plus the embedding, the final norm and lm_head (none when the embeddings are tied).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "shadowsync/layout.h"

namespace shadowsync::bench {

struct ModelConfig {
  std::string name;
  std::int64_t hidden = 0;
  std::int64_t intermediate = 0;
  std::int64_t layers = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t vocab = 0;
  bool qkv_bias = false;
  bool tied_embeddings = false;
};

inline std::vector<ModelConfig> known_models() {
  return {
      // Qwen/Qwen2.5-0.5B config.json
      {"qwen2.5-0.5b", 896, 4864, 24, 14, 2, 64, 151936, true, true},
      // meta-llama/Meta-Llama-3-8B config.json
      {"llama3-8b", 4096, 14336, 32, 32, 8, 128, 128256, false, false},
      // Qwen/Qwen2.5-14B config.json
      {"qwen2.5-14b", 5120, 13824, 48, 40, 8, 128, 152064, true, false},
  };
}

inline const ModelConfig* find_model(const std::string& name) {
  static const std::vector<ModelConfig> models = known_models();
  for (const ModelConfig& m : models) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

// The models a "--models a,b" list names, in its order; an empty list names every known model.
// Throws std::invalid_argument naming an unknown model and the known ones.
inline std::vector<ModelConfig> models_named(const std::string& list) {
  if (list.empty()) return known_models();
  std::vector<ModelConfig> models;
  std::size_t begin = 0;
  while (begin <= list.size()) {
    const std::size_t end = std::min(list.find(',', begin), list.size());
    const std::string name = list.substr(begin, end - begin);
    const ModelConfig* m = find_model(name);
    if (m == nullptr) {
      std::string known;
      for (const ModelConfig& k : known_models()) known += (known.empty() ? "" : ", ") + k.name;
      throw std::invalid_argument("unknown model '" + name + "' (known: " + known + ")");
    }
    models.push_back(*m);
    begin = end + 1;
  }
  return models;
}

// The tensor specs of `m`, every dimension divided by `scale` (rounded up; layers and tensor count
// unchanged): scale 1 is the real model, larger scales are the CPU smoke mode's miniatures.
inline std::vector<TensorSpec> model_specs(const ModelConfig& m, std::int64_t scale = 1) {
  const auto d = [scale](std::int64_t x) { return std::max<std::int64_t>(1, (x + scale - 1) / scale); };
  const std::int64_t hidden = d(m.hidden);
  const std::int64_t ffn = d(m.intermediate);
  const std::int64_t vocab = d(m.vocab);
  const std::int64_t q_out = d(m.heads * m.head_dim);
  const std::int64_t kv_out = d(m.kv_heads * m.head_dim);
  const DType bf16 = DType::kBFloat16;

  std::vector<TensorSpec> specs;
  specs.push_back({"model.embed_tokens.weight", bf16, {vocab, hidden}});
  for (std::int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    specs.push_back({p + "self_attn.q_proj.weight", bf16, {q_out, hidden}});
    if (m.qkv_bias) specs.push_back({p + "self_attn.q_proj.bias", bf16, {q_out}});
    specs.push_back({p + "self_attn.k_proj.weight", bf16, {kv_out, hidden}});
    if (m.qkv_bias) specs.push_back({p + "self_attn.k_proj.bias", bf16, {kv_out}});
    specs.push_back({p + "self_attn.v_proj.weight", bf16, {kv_out, hidden}});
    if (m.qkv_bias) specs.push_back({p + "self_attn.v_proj.bias", bf16, {kv_out}});
    specs.push_back({p + "self_attn.o_proj.weight", bf16, {hidden, q_out}});
    specs.push_back({p + "mlp.gate_proj.weight", bf16, {ffn, hidden}});
    specs.push_back({p + "mlp.up_proj.weight", bf16, {ffn, hidden}});
    specs.push_back({p + "mlp.down_proj.weight", bf16, {hidden, ffn}});
    specs.push_back({p + "input_layernorm.weight", bf16, {hidden}});
    specs.push_back({p + "post_attention_layernorm.weight", bf16, {hidden}});
  }
  specs.push_back({"model.norm.weight", bf16, {hidden}});
  if (!m.tied_embeddings) specs.push_back({"lm_head.weight", bf16, {vocab, hidden}});
  return specs;
}

inline Layout model_layout(const ModelConfig& m, std::int64_t scale, std::size_t bucket_bytes) {
  return Layout::build(model_specs(m, scale), {.bucket_bytes = bucket_bytes});
}

inline std::int64_t element_count(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t x : shape) n *= x;
  return n;
}

inline std::int64_t parameter_count(const Layout& layout) {
  std::int64_t n = 0;
  for (const auto& group : layout.groups()) {
    for (const auto& t : group.tensors()) n += element_count(t.spec.shape);
  }
  return n;
}

inline std::size_t largest_tensor_bytes(const Layout& layout) {
  std::size_t largest = 0;
  for (const auto& group : layout.groups()) {
    for (const auto& t : group.tensors()) largest = std::max(largest, t.bytes);
  }
  return largest;
}

}  // namespace shadowsync::bench
