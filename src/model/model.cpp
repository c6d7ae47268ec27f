// model/model.hpp's entry points, each asking the config's family, and the unsharded forward/backward.
#include "model/model.hpp"

#include "model/adapter_layers.hpp"
#include "model/family.hpp"
#include "model/saved_activations.hpp"

namespace shardtrain {

template <typename Real>
std::unique_ptr<TransformerModel<Real>> make_model(const ParamTable& table, int batch, int seq_len,
                                                   Checkpointing activation_checkpointing, const LayerOps<Real>& ops,
                                                   DType activation_dtype) {
  return family_of(table.config()).make_model(table, batch, seq_len, activation_checkpointing, ops, activation_dtype);
}

std::vector<size_t> plan_saved_tensor_elements(const ModelConfig& config, int batch, int seq_len) {
  return family_of(config).saved_tensor_elements(config, batch, seq_len);
}

size_t plan_activation_bytes(const ParamTable& table, int batch, int seq_len, Checkpointing activation_checkpointing,
                             size_t real_bytes, DType activation_dtype) {
  const ModelConfig& config = table.config();
  const ModelFamily& family = family_of(config);
  size_t elements = 0;
  for (size_t n : family.activation_arrays(config, batch, seq_len, activation_checkpointing, activation_dtype))
    elements += n;
  const std::vector<size_t> saved = plan_saved_tensor_elements(config, batch, seq_len);
  const int saved_layers = activation_checkpointing.run(0, config.n_layer).sets();
  return elements * real_bytes +
         SavedActivations<float>::plan_bytes(activation_dtype, saved_layers, saved, real_bytes) +
         plan_adapter_bytes(table, family.product_rows(config, batch, seq_len), real_bytes,
                            family.adapter_key_rows(config, batch, seq_len)) +
         family.id_bytes(config, batch, seq_len);
}

size_t plan_decode_bytes(const ParamTable& table, int max_len, int max_chunk, size_t real_bytes) {
  const ModelConfig& config = table.config();
  return family_of(config).plan_decode_elements(config, max_len, max_chunk) * real_bytes +
         plan_adapter_bytes(table, max_chunk, real_bytes) +
         static_cast<size_t>(max_chunk) * sizeof(int);  // + the step's tokens
}

template <typename Real>
double forward_backward_unsharded(TransformerModel<Real>& model, const ParamTable& table,
                                  const std::vector<const Real*>& units, const std::vector<Real*>& unit_grads,
                                  const Batch& batch, Real dloss) {
  const int L = table.block_count();
  model.embed_forward(units[ROOT_UNIT], batch);
  for (int l = 0; l < L; l++) model.block_forward(l, units[block_unit(l)]);
  model.loss().prepare(batch);
  double loss = model.host_head_forward(units[ROOT_UNIT], batch);
  model.head_backward(unit_grads[ROOT_UNIT], units[ROOT_UNIT], dloss);
  for (int l = L - 1; l >= 0; l--) model.block_backward(l, unit_grads[block_unit(l)], units[block_unit(l)]);
  model.embed_backward(unit_grads[ROOT_UNIT]);
  return loss;
}

template std::unique_ptr<TransformerModel<float>> make_model<float>(const ParamTable&, int, int, Checkpointing,
                                                                    const LayerOps<float>&, DType);
template std::unique_ptr<TransformerModel<double>> make_model<double>(const ParamTable&, int, int, Checkpointing,
                                                                      const LayerOps<double>&, DType);
template double forward_backward_unsharded<float>(TransformerModel<float>&, const ParamTable&,
                                                  const std::vector<const float*>&, const std::vector<float*>&,
                                                  const Batch&, float);
template double forward_backward_unsharded<double>(TransformerModel<double>&, const ParamTable&,
                                                   const std::vector<const double*>&, const std::vector<double*>&,
                                                   const Batch&, double);

}  // namespace shardtrain
