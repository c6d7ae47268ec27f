// See adapter_layers.hpp: the method the table's adapter.type names.
#include "model/adapter_layers.hpp"

#include "model/delta_adapters.hpp"
#include "model/lora.hpp"

namespace shardtrain {

template <typename Real>
std::unique_ptr<AdapterLayers<Real>> make_adapter_layers(const ParamTable& table, int rows, const LayerOps<Real>& ops,
                                                         int key_rows) {
  if (table.adapter().type == ADAPTER_NONE) return nullptr;
  if (table.adapter().weight_delta()) return std::make_unique<DeltaLayers<Real>>(table, rows, ops);
  return std::make_unique<LoraLayers<Real>>(table, rows, ops, key_rows < 0 ? rows : key_rows);
}

size_t plan_adapter_bytes(const ParamTable& table, int rows, size_t real_bytes, int key_rows) {
  if (table.adapter().weight_delta()) return DeltaLayers<float>::plan_bytes(table, rows, real_bytes);
  return LoraLayers<float>::plan_bytes(table, rows, real_bytes, key_rows < 0 ? rows : key_rows);
}

template std::unique_ptr<AdapterLayers<float>> make_adapter_layers(const ParamTable&, int, const LayerOps<float>&,
                                                                   int);
template std::unique_ptr<AdapterLayers<double>> make_adapter_layers(const ParamTable&, int, const LayerOps<double>&,
                                                                    int);

}  // namespace shardtrain
