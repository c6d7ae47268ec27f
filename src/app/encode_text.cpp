// See encode_text.hpp.
#include "app/encode_text.hpp"

#include <hdf5.h>

#include <algorithm>
#include <boost/program_options.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <filesystem>

#include "app/compute_backend.hpp"
#include "app/inference.hpp"
#include "app/options.hpp"
#include "app/perf.hpp"
#include "app/sample.hpp"
#include "app/text_encoder.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "ckpt/h5.hpp"
#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "core/clock.hpp"
#include "core/counted.hpp"
#include "core/format.hpp"
#include "model/families/flux/flux_family.hpp"

namespace shardtrain {

namespace po = boost::program_options;

namespace {

struct EncodeTextOptions {
  TextEncoderOptions encoder;
  std::string input, output, device = "cpu";
  int tokens = 0, batch = 8, threads = 0;
  double comm_timeout = 300;
};

bool parse_encode_text_args(const Runtime& rt, const std::vector<std::string>& args, EncodeTextOptions& o) {
  std::string tokens, batch = "8", threads = "0", timeout = "300";
  po::options_description desc(
      "usage: shardtrain encode-text --text-encoder SRC --tokens L --input FILE.h5 --output FILE.h5 [--layers LIST] "
      "[--tokenizer FILE] [--batch B]\n\nencode-text options");
  desc.add_options()  // one option per line
      ("help,h", "print the options")
      ("text-encoder", po::value(&o.encoder.source)->required(),
       "the text encoder: a ShardTrain checkpoint or Hugging Face folder of a language model (Llama, Qwen2, GPT-2)")
      ("tokenizer", po::value(&o.encoder.tokenizer), "its tokenizer.json; default: the folder's, or the checkpoint's")
      ("layers", po::value(&o.encoder.layers)->default_value(o.encoder.layers),
       "hidden states side by side, as text_encoder.layers (0 the embeddings, -1 the final norm's output)")
      ("tokens", po::value(&tokens)->required(), "ids per caption (the model's model.context_len): cut, or padded")
      ("input", po::value(&o.input)->required(), "HDF5 file whose `captions` (strings) to encode")
      ("output", po::value(&o.output)->required(),
       "HDF5 file to write: the input with encoder_hidden_states (P, tokens, K x n_embd) and pooled_projections "
       "(P, K x n_embd) in place")
      ("batch", po::value(&batch)->default_value(batch), "captions per forward on each rank")
      ("device", po::value(&o.device)->default_value(o.device), "cpu or cuda (one GPU per rank)")
      ("threads", po::value(&threads)->default_value(threads), "threads per rank; 0 = the cores available to the rank")
      ("comm-timeout", po::value(&timeout)->default_value(timeout),
       "seconds before a stuck collective aborts every rank; 0 = off");
  po::variables_map vm;
  if (!parse_command_options(rt, args, desc, "encode-text", vm)) return false;
  o.tokens = static_cast<int>(parse_whole_number(tokens, "--tokens", 1, 1 << 20));
  o.batch = static_cast<int>(parse_whole_number(batch, "--batch", 1, 1 << 16));
  o.threads = static_cast<int>(parse_whole_number(threads, "--threads", 0, 1 << 16));
  o.comm_timeout = parse_real(timeout, "comm-timeout", "give seconds >= 0 (0 = off)", 0, 1e9, true, "encode-text");
  if (o.device != "cpu" && o.device != "cuda")
    throw UsageError("--device='" + printable_text(o.device) + "' is not a device; allowed: cpu, cuda");
  if (std::filesystem::weakly_canonical(o.input) == std::filesystem::weakly_canonical(o.output))
    throw UsageError("--output='" + o.output + "' is --input: write the embeddings to another file");
  return true;
}

herr_t copy_attribute(hid_t from, const char* name, const H5A_info_t*, void* to) {
  H5Id attr(H5Aopen(from, name, H5P_DEFAULT), H5Aclose);
  H5Id type(H5Aget_type(attr), H5Tclose), space(H5Aget_space(attr), H5Sclose);
  std::vector<unsigned char> bytes(H5Aget_storage_size(attr) + H5Tget_size(type));
  H5Id copy(H5Acreate2(*static_cast<hid_t*>(to), name, type, space, H5P_DEFAULT, H5P_DEFAULT), H5Aclose);
  if (attr.get() < 0 || copy.get() < 0 || H5Aread(attr, type, bytes.data()) < 0 || H5Awrite(copy, type, bytes.data()) < 0)
    return -1;
  return 0;
}

// `tmp`: `input` with every root dataset but the two embeddings copied (H5Ocopy), the root
// attributes too, and those two created empty at their full shapes, for write_rows to fill.
void create_encoded_file(const std::string& input, const std::string& tmp, hsize_t P, hsize_t L, hsize_t D) {
  H5QuietErrors quiet;
  H5Id in(H5Fopen(input.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
  if (in.get() < 0) throw DataError("--input='" + input + "' is not an HDF5 file");
  H5Id out(h5_check_id(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT), tmp, "H5Fcreate"), H5Fclose);
  H5G_info_t info;
  h5_check(H5Gget_info(in, &info), input, "H5Gget_info");
  for (hsize_t i = 0; i < info.nlinks; i++) {
    char name[1024];
    if (H5Lget_name_by_idx(in, ".", H5_INDEX_NAME, H5_ITER_INC, i, name, sizeof name, H5P_DEFAULT) < 0) continue;
    if (std::strcmp(name, FLUX_ENCODER_HIDDEN_STATES) == 0 || std::strcmp(name, FLUX_POOLED) == 0) continue;
    h5_check(H5Ocopy(in, name, out, name, H5P_DEFAULT, H5P_DEFAULT), tmp, name);
  }
  hsize_t index = 0;
  hid_t target = out;
  h5_check(H5Aiterate2(in, H5_INDEX_NAME, H5_ITER_INC, &index, copy_attribute, &target), tmp, "copying attributes");
  const std::pair<const char*, std::vector<hsize_t>> sets[2] = {{FLUX_ENCODER_HIDDEN_STATES, {P, L, D}},
                                                               {FLUX_POOLED, {P, D}}};
  for (const auto& [name, dims] : sets) {
    H5Id space(h5_check_id(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), tmp, name),
               H5Sclose);
    H5Id set(h5_check_id(H5Dcreate2(out, name, H5T_IEEE_F32LE, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), tmp,
                         name),
             H5Dclose);
  }
}

// Records [first, first + rows) of the two embedding datasets of `tmp` from context (rows x L x D)
// and pooled (rows x D).
void write_rows(const std::string& tmp, hsize_t first, hsize_t rows, const float* context, const float* pooled,
                hsize_t L, hsize_t D) {
  H5QuietErrors quiet;
  H5Id file(h5_check_id(H5Fopen(tmp.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), tmp, "H5Fopen"), H5Fclose);
  const std::tuple<const char*, std::vector<hsize_t>, const float*> parts[2] = {
      {FLUX_ENCODER_HIDDEN_STATES, {rows, L, D}, context}, {FLUX_POOLED, {rows, D}, pooled}};
  for (const auto& [name, count, values] : parts) {
    H5Id set(h5_check_id(H5Dopen2(file, name, H5P_DEFAULT), tmp, name), H5Dclose);
    H5Id space(h5_check_id(H5Dget_space(set), tmp, name), H5Sclose);
    std::vector<hsize_t> start(count.size(), 0);
    start[0] = first;
    h5_check(H5Sselect_hyperslab(space, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr), tmp, name);
    H5Id memory(h5_check_id(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), tmp, name),
                H5Sclose);
    h5_check(H5Dwrite(set, H5T_NATIVE_FLOAT, memory, space, H5P_DEFAULT, values), tmp, name);
  }
}

int encode_text(const Runtime& rt, const EncodeTextOptions& o) {
  Watchdog watchdog(o.comm_timeout, "--comm-timeout");
  ComputeBackend compute(ComputeOptions{o.device}, rt);
  auto comm = make_mpi_comm(rt.world_comm(), &watchdog);
  set_compute_threads(o.threads > 0 ? o.threads : default_threads_per_rank(rt.local_size()));
  std::vector<std::string> captions;
  std::shared_ptr<const CaptionTokenizer> tokenizer;
  ModelConfig shape;  // what the encoder is checked against: a denoiser taking its output
  rt.agree_on([&] {
    captions = read_prompt_captions(o.input, "--input");
    tokenizer = text_encoder_tokenizer(o.encoder, o.tokens);
    const ModelConfig encoder = text_encoder_param_table(o.encoder, QuantConfig{}).config();
    shape.context_len = o.tokens;
    shape.context_dim = shape.pooled_dim =
        static_cast<int>(parse_hidden_layers(o.encoder.layers, encoder.n_layer).size()) * encoder.n_embd;
  });
  auto shard = compute.make_comm(rt.split_world(0, rt.rank()), &watchdog);
  auto replica = compute.make_comm(rt.split_world(rt.rank(), 0), &watchdog);
  TextEncoder encoder(rt, *comm, *shard, *replica, compute, inference_options(rt, compute), o.encoder, QuantConfig{},
                      tokenizer, shape, o.batch, &watchdog);
  const int P = static_cast<int>(captions.size()), L = o.tokens, D = shape.context_dim, B = o.batch;
  // This rank's slice, in micro-batches of B: the same number on every rank (each forward is collective).
  const int per_rank = (P + rt.world() - 1) / rt.world();
  const int first = std::min(P, rt.rank() * per_rank), count = std::min(P, first + per_rank) - first;
  const int rounds = (per_rank + B - 1) / B;
  const std::string tmp = o.output + ".tmp";
  rt.agree_on([&] {
    if (rt.is_root()) create_encoded_file(o.input, tmp, P, L, D);
  });
  std::vector<int32_t> ids(static_cast<size_t>(B) * L), lengths(B);
  std::vector<float> context(static_cast<size_t>(B) * L * D), pooled(static_cast<size_t>(B) * D);
  const double t0 = now_seconds();
  for (int round = 0; round < rounds; round++) {
    const int begin = first + round * B, rows = std::clamp(count - round * B, 0, B);
    std::fill(ids.begin(), ids.end(), 0);
    std::fill(lengths.begin(), lengths.end(), 0);
    rt.agree_on([&] {
      for (int i = 0; i < rows; i++)
        lengths[i] = tokenizer->tokenize(captions[begin + i], ids.data() + static_cast<size_t>(i) * L,
                                         strprintf("--input='%s': caption %d", o.input.c_str(), begin + i));
    });
    encoder.encode(ids.data(), lengths.data(), B, context.data(), pooled.data());
    for (int writer = 0; writer < rt.world(); writer++)  // one rank at a time into the (serial) file
      rt.agree_on([&] {
        if (rt.rank() == writer && rows > 0) write_rows(tmp, begin, rows, context.data(), pooled.data(), L, D);
      });
  }
  const double seconds = now_seconds() - t0;
  rt.agree_on([&] {
    if (rt.is_root() && std::rename(tmp.c_str(), o.output.c_str()) != 0)
      throw UsageError("cannot write --output='" + printable_text(o.output) + "': " + std::strerror(errno));
  });
  if (rt.is_root())
    std::fprintf(stderr, "encode-text: %s of %s by %s (%s) on %s in %.2f s: %s (encoder_hidden_states %d x %d x %d)\n",
                 counted(P, "caption").c_str(), o.input.c_str(), o.encoder.source.c_str(),
                 model_summary(encoder.config()).c_str(), counted(rt.world(), "rank").c_str(), seconds,
                 o.output.c_str(), P, L, D);
  return EXIT_CODE_OK;
}

}  // namespace

int run_encode_text(Runtime& rt, const std::vector<std::string>& args) {
  EncodeTextOptions options;
  bool go = true;
  rt.agree_on([&] { go = parse_encode_text_args(rt, args, options); });
  if (!go) return EXIT_CODE_OK;
  rt.set_collective_timeout({options.comm_timeout, "--comm-timeout"});
  return encode_text(rt, options);
}

}  // namespace shardtrain
