// OFT's rotations (PEFT 0.21.2, docs/adapters.md): each block's b (b - 1) / 2 parameters v fill the
// strict upper triangle of U row by row ((0,1), (0,2), ..., (1,2), ...), Q = U - U^T is skew, and
//   Cayley-Neumann (PEFT's default), T terms:  R = I + 2Q + 2Q^2 + ... + 2Q^(T-2) + Q^(T-1)
//     (T <= 1: I; T = 2: I + 2Q; T = 3 is T = 4's series, as PEFT computes it),
//   exact Cayley:                              R = (I - Q)(I + Q)^-1  (orthogonal; note the sign).
// The layer's inputs are rotated block by block, x~ = x blockdiag(R_1, ...), which is the weight
// W blockdiag(R_1, ...)^T. Host arithmetic in double on b x b blocks: small next to the layer.
#pragma once

namespace shardtrain {

struct OftRotation {
  int block;  // b
  bool cayley_neumann;
  int neumann_terms;
  // R (b x b, row-major) of the parameters v (b (b - 1) / 2).
  void forward(const double* v, double* R) const;
  // dv += the gradient through R of dR = d loss / d R.
  void backward(const double* v, const double* dR, double* dv) const;
};

}  // namespace shardtrain
