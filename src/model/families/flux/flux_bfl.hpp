// Black Forest Labs' single-file layout of FLUX.1 (flux1-dev.safetensors, flux1-schnell.safetensors
// and Kontext's, as their reference code names the modules; ComfyUI's copies under
// "model.diffusion_model." read once the loader strips that prefix): the FLUX family's
// single_file_* hooks (model/family.hpp). Against diffusers' names (ours): q, k and v are one fused
// tensor -- a double block's img_attn.qkv and txt_attn.qkv, a single block's linear1 = q | k | v |
// MLP in --, and the final modulation's two halves are stored (shift, scale) where diffusers keeps
// (scale, shift) (diffusers' convert_flux_to_diffusers.py swaps them). The file records no
// configuration: widths and block counts come from the tensors' shapes, the head count from the
// q/k norms' width, guidance_embeds from guidance_in's presence; rotary axes are FLUX.1's (16, 56,
// 56) for its heads of 128, the only head size these files have.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

bool is_bfl_flux_file(const TensorShapes& tensors);
// CheckpointError naming `path` when the shapes make no FLUX model.
ModelConfig bfl_flux_config(const TensorShapes& tensors, const std::string& path);
// Our (diffusers-named) parameter's tensor and rows in the file.
HfTensor bfl_flux_tensor(const ModelConfig& config, const ParamInfo& param);

}  // namespace shardtrain
