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
//
// FLUX.2's files (flux2-dev.safetensors; diffusers' convert_flux2_transformer_checkpoint_to_diffusers
// reads them) likewise: no biases, no pooled vector, the shared modulations
// (double_stream_modulation_img.lin, ..._txt.lin, single_stream_modulation.lin), the double blocks'
// q, k and v fused as in FLUX.1, a single block's linear1 (q | k | v | SwiGLU in) and linear2 named
// so but otherwise diffusers' own tensors, the final modulation's halves swapped; its rotary axes
// (32, 32, 32, 32) and theta 2000 are Flux2Transformer2DModel's defaults, the MLP width half the
// rows of its input product.
#pragma once

#include "model/family.hpp"

namespace shardtrain {

// Whether the tensors are BFL's FLUX.1 (flux2 false) or FLUX.2 (flux2 true) layout.
bool is_bfl_flux_file(const TensorShapes& tensors, bool flux2);
// CheckpointError naming `path` when the shapes make no FLUX model.
ModelConfig bfl_flux_config(const TensorShapes& tensors, const std::string& path, bool flux2);
// Our (diffusers-named) parameter's tensor and rows in the file.
HfTensor bfl_flux_tensor(const ModelConfig& config, const ParamInfo& param);

}  // namespace shardtrain
