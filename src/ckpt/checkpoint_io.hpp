// Parallel HDF5 checkpoints: every rank writes and reads only the part of each dataset that its
// shards own, collectively (MPI-IO), so no rank ever holds more than its shards. Two layouts of
// one versioned format (docs/checkpoint-format.md):
//   gathered: /model/<param>, /optim/exp_avg/<param>, /optim/exp_avg_sq/<param>, full shapes;
//   sharded:  /shards/<unit>/{params,exp_avg,exp_avg_sq}, each unit's flat buffer as written by
//             the ranks (padded), with an index attribute mapping parameters to flat offsets.
// A run with a quantized frozen base (fsdp.frozen_dtype) stores those weights in either layout as
// /quantized/<param>: uint8 [blocks, record bytes], the records it holds (backend/quant.hpp), and
// neither their fp32 values nor moments; any run loads them, dequantized (and quantized again
// where it holds them quantized).
// An adapter-only checkpoint (checkpoint.adapters_only) holds the adapters' parameters alone, in
// either layout (sharded: each unit's adapters laid end to end), and the checksum of the base model
// they were trained on (base_model_checksum), which a resume compares with the base it loaded.
// Both load on any rank count: each rank reads the intersection of its new slice with each
// dataset. Every dataset carries a checksum (a wrapping sum over elements of a hash of (flat
// index, value bits)) that is independent of how the elements were split over ranks; the root
// attributes carry one more (`meta_checksum`, FNV-1a over every attribute's name and value).
//
// One validation serves training and the tools: load_checkpoint and CheckpointReader both check the
// metadata (format, version, checksum, sane values), that the file holds exactly the datasets of
// its layout for its model, their shapes, and every data checksum.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>

#include "backend/quant.hpp"
#include "comm/comm.hpp"
#include "core/error.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"

namespace shardtrain {

class Watchdog;

constexpr const char* CKPT_FORMAT_NAME = "shardtrain-checkpoint";
// 7: a quantized frozen base's weights as their records (/quantized/<param>); 6: the model keys
// of the families beyond the decoders (FLUX's); 5: LoKr's and OFT's settings and
// the teacher's checksum; 4: adapter-only files and the base model's checksum; 3: the adapter's
// settings; 2: the model's architecture (1: gpt2); all still read.
constexpr int64_t CKPT_FORMAT_VERSION = 10;

// Everything besides the tensors that resuming needs.
struct CheckpointState {
  std::string layout = "sharded";  // sharded | gathered
  int64_t step = 0;                // optimizer steps completed
  int64_t tokens_seen = 0;
  uint64_t seed = 0;               // init and data-order seed; the sampler is a pure function of it
  int64_t sampler_step = 0;        // the sampler's position: the next step's sequences
  int64_t world_size = 1;
  std::string strategy = "FULL_SHARD";
  std::string config_ini;          // the full resolved configuration at save time
  ModelConfig model;               // the model's shape (also in config_ini)
  AdapterConfig adapter;           // its adapters (type none: none; files before version 3 have none)
  int64_t loss_scale_log2 = 0;     // fp16 dynamic loss scale = 2^loss_scale_log2
  int64_t loss_scale_good_steps = 0;  // finite steps since the scale last changed
  // The data's identity (TokenDataset::identity of data.train_file and data.val_file: a line
  // "<bytes> <path>" per file); always written, read when present (has_dataset; older files lack it).
  std::string dataset_train, dataset_val;
  bool has_dataset = false;
  // Version 4. adapters_only: the file holds the adapters' parameters and moments alone (the base
  // model comes from checkpoint.init_from); base_checksum: base_model_checksum of the base model the
  // run had at save time, written by every save (save_checkpoint computes it; the field is ignored
  // there). has_base_checksum: read only, the file records it (version 4).
  bool adapters_only = false;
  uint64_t base_checksum = 0;
  bool has_base_checksum = false;
  // Version 5: the distillation teacher's checksum (base_model_checksum of its weights), 0 without one.
  uint64_t teacher_checksum = 0;
  // A text encoder in the job (text_encoder.*): its source, hidden-state layers (the option's text),
  // tokenizer, the format its weights were held in (dtype name, block, all linear layers) and those
  // weights' checksum; optional attributes, written with one (empty source: none).
  std::string text_encoder, text_encoder_layers, text_encoder_tokenizer, text_encoder_dtype = "fp32";
  int64_t text_encoder_quant_block = 64, text_encoder_all_linear = 0;
  uint64_t text_encoder_checksum = 0;
  // Version 7, read only (a save writes its run's): the format and block of the records in
  // /quantized ("" and 0: the file has none; every parameter is fp32).
  std::string quantized_dtype;
  int64_t quantized_block = 0;
  // Version 9: 1 when the records' absmax are double-quantized codes, each weight's offset and
  // group scales in /quantized_nested/<param>; written only then (absent: 0).
  int64_t quantized_double_quant = 0;
  std::string warning;             // read only: why the file is usable but not fully verified ("" if it is)
  int64_t version = CKPT_FORMAT_VERSION;  // read only: the file's format version (saves write CKPT_FORMAT_VERSION)
};

// What a file holds of its table's parameters: every one, or (adapters_only) the adapters' alone;
// and the quantized frozen weights of the run that saved it (`records`, by parameter id) as their
// records in /quantized/<param> -- bitsandbytes-style blocks of `quant`, never fp32 values or
// moments, which they do not have.
struct CheckpointContent {
  bool adapters_only = false;
  std::vector<bool> records;
  QuantType quant = QUANT_NONE;
  size_t block = 0;
  bool in_records(const ParamInfo& p) const { return !records.empty() && records[p.id]; }
  // Whether the flat or per-parameter fp32 datasets (values, moments) hold p.
  bool stored(const ParamInfo& p) const { return (!adapters_only || p.adapter) && !in_records(p); }
  bool holds(const ParamInfo& p) const { return stored(p) || in_records(p); }
  bool nested = false;  // double quantization: /quantized_nested holds each weight's offset and group scales
  size_t record_bytes() const { return quant_record_bytes(quant, block, nested); }
  uint64_t blocks(const ParamInfo& p) const { return (p.numel + block - 1) / block; }
  uint64_t groups(const ParamInfo& p) const { return nested_groups(blocks(p)); }
};

// The ranks that write or read one checkpoint together, and how they talk: `comm` (on host
// memory) carries our own collectives -- agreement, checksums -- and times them; `file_comm` is the
// same ranks as the MPI communicator parallel HDF5 needs (from Runtime::world_comm); `watchdog`
// (may be null) times each of HDF5's collective calls on its own, never a whole save;
// `folder_option` is the setting that chose where the file goes, named when the disk is full.
struct CheckpointComm {
  Comm& comm;
  MPI_Comm file_comm;
  Watchdog* watchdog = nullptr;
  const char* folder_option = "checkpoint.dir";
};

// Collective over `ranks`. Writes `path` (created or truncated). Throws CheckpointError, the same on
// every rank (each collective phase agrees on its outcome, so no rank is left in HDF5's barriers).
// Rank 0 first reserves the file's disk space (fallocate) unless the environment variable
// SHARDTRAIN_CHECKPOINT_PREALLOCATE is 0: a full disk is then reported before HDF5 holds the file.
void save_checkpoint(const std::string& path, const CheckpointState& state, FsdpEngine& engine, AdamW& optimizer,
                     const CheckpointComm& ranks);

// Collective over `ranks`. A checkpoint of weights alone, without an optimizer (`shardtrain
// convert`): its moments are zeros -- a fresh optimizer's, so only at step 0 -- written without
// ever being held in memory (the datasets are left unwritten: zeros in the file), with the
// checksum of zeros. Training resumes or starts from it as from any checkpoint of step 0.
void save_checkpoint_weights(const std::string& path, const CheckpointState& state, FsdpEngine& engine,
                             const CheckpointComm& ranks);

// Collective over `ranks`. Reads the metadata, checks format, version and that the model shape
// and adapters match `engine`'s, then fills this rank's shards and moments and verifies every
// checksum. base_model_ok: a file without adapters may load under adapters (checkpoint.init_from),
// filling the base model; the adapters keep their values. An adapter-only file fills the adapters
// and their moments alone, over the base model that `engine` already holds, which must have the
// file's base checksum. Throws CheckpointError naming the file and the defect.
CheckpointState load_checkpoint(const std::string& path, FsdpEngine& engine, AdamW& optimizer,
                                const CheckpointComm& ranks, bool base_model_ok = false);

// Collective over `ranks`. load_checkpoint of the parameters alone (no optimizer: `shardtrain
// convert`, which needs no moments): the moments' datasets are checked for their shape but neither
// read nor verified against their checksums. An adapter-only file loads as with load_checkpoint
// (onto the base the engine holds); convert refuses every file with adapters before.
// base_model_ok as load_checkpoint's.
CheckpointState load_checkpoint_weights(const std::string& path, FsdpEngine& engine, const CheckpointComm& ranks,
                                        bool base_model_ok = false);

// "" when the shapes agree, else a message naming every model.* key that differs.
std::string model_mismatch(const std::string& path, const ModelConfig& stored, const ModelConfig& configured);
// The same for the adapters (type, targets, rank: what fixes their parameters).
std::string adapter_mismatch(const std::string& path, const AdapterConfig& stored, const AdapterConfig& configured);

// Collective over `comm` (all ranks of the engine). The base model's identity: the element checksum
// (checksum_elements) of its parameters -- every one that is not an adapter's -- laid end to end in
// declaration order, unit after unit; each rank hashes the elements it owns. It does not depend on
// the rank count, strategy, layout or what is frozen (docs/checkpoint-format.md, "Base checksum").
uint64_t base_model_checksum(FsdpEngine& engine, Comm& comm);
// The refusal of an adapter-only checkpoint over another base: names the file, both checksums and
// the fix. `base_from` says where the loaded base came from (e.g. "checkpoint.init_from='...'").
std::string base_mismatch(const std::string& path, uint64_t stored, uint64_t loaded, const std::string& base_from);
// A base checksum as it is printed: 0x and 16 hexadecimal digits.
std::string checksum_text(uint64_t checksum);

// Whether the file begins with HDF5's signature (a checkpoint, as opposed to an llm.c file).
bool is_hdf5_file(const std::string& path);

// Reads and checks only the root attributes (serial open), for choosing a checkpoint.
CheckpointState read_checkpoint_state(const std::string& path);

// Serial, whole-tensor access to a checkpoint of either layout, one parameter at a time (for
// `inspect` and `export`, which must not need the model in memory).
class CheckpointReader {
 public:
  enum Tensor { TENSOR_PARAMS, TENSOR_EXP_AVG, TENSOR_EXP_AVG_SQ };
  // Validates the whole file as load_checkpoint does (reading each dataset once, in bounded
  // pieces); throws CheckpointError naming the file and the defect.
  explicit CheckpointReader(const std::string& path);
  ~CheckpointReader();
  const CheckpointState& state() const { return state_; }
  // The file's parameter table: its model with its adapters.
  const ParamTable& table() const { return *table_; }
  // Whether the file holds the parameter (of table(), or of a table of the same model without
  // adapters): all do, but an adapter-only file holds the adapters alone.
  bool holds(const ParamInfo& param) const;
  // The values of one parameter (its numel elements, row-major); the file must hold it.
  // A double-quantized weight's offset and group scales (/quantized_nested), or empty.
  std::vector<float> nested_table(const ParamInfo& param) const;
  std::vector<float> read(const ParamInfo& param, const std::string& unit_name, Tensor tensor) const;
  // What the file holds where: which parameters are quantized records, in which format.
  const CheckpointContent& content() const { return content_; }
  // The HDF5 path holding the parameter in this layout.
  std::string dataset_path(const ParamInfo& param, const std::string& unit_name, Tensor tensor) const;

 private:
  std::string path_;
  int64_t file_ = -1;
  CheckpointState state_;
  std::unique_ptr<ParamTable> table_;
  CheckpointContent content_;
};

// The element checksum shared by writer, reader and tests.
uint64_t checksum_elements(const float* values, size_t count, uint64_t first_index);

}  // namespace shardtrain
