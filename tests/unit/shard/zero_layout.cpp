// The checkpoint layout of sharded optimizers is pinned: which files
// save_state writes, and the keys and shapes inside each rank's optimizer
// archive (the chunk of each bucket its optimizer steps). A change to bucket
// planning that moved a parameter into another bucket, changed the padding or
// the order of the chunks would make old checkpoints load into the wrong
// places; this test says so before a user's resume does.
#include <accel/accelerator.hpp>
#include <accel/checkpoint.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <regex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "catch.hpp"

#include "paths.hpp"

namespace {

namespace fs = std::filesystem;

/// Linear(5, 4) -> Linear(4, 3) in two parameter groups (one per layer), two
/// steps of Adam, then save_state(dir). bucket_cap_mb = 1e-4 (104 bytes):
/// buckets in reverse registration order, one per group, each padded to a
/// multiple of 2: [bias2 3, weight2 12] = 15 -> 16, chunk 8 (group 1);
/// [bias1 4, weight1 20] = 24, chunk 12 (group 0).
template <class Shard>
void train_and_save(std::string dir) {
  accel::Accelerator<accel::backend::Gloo, accel::precision::Fp32, Shard> acc(
      accel::AcceleratorOptions{.bucket_cap_mb = 1e-4});
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(5, 4), torch::nn::ReLU(), torch::nn::Linear(4, 3));
  auto params = model->parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>(params.begin(), params.begin() + 2),
                      std::make_unique<torch::optim::AdamOptions>(1e-2));
  groups.emplace_back(std::vector<torch::Tensor>(params.begin() + 2, params.end()));
  torch::optim::Adam adam(std::move(groups), torch::optim::AdamOptions(1e-3));
  auto [m, opt] = acc.prepare(model, adam);
  for (int step = 0; step < 2; ++step) {
    auto x = torch::randn({6, 5});
    acc.backward(m(x).pow(2).sum());
    opt.step();
    opt.zero_grad();
  }
  acc.save_state(dir);
  // What each chunk holds: the bucket's parameters in reverse registration
  // order (bias before weight), padded with zeros, cut in world-size pieces.
  const int64_t r = acc.process_index();
  torch::NoGradGuard no_grad;
  const auto bucket1 = torch::cat({params[1], params[0].reshape(-1)});
  const auto bucket0 = torch::cat({params[3], params[2].reshape(-1), torch::zeros({1})});
  auto& groups_now = opt->param_groups();
  if (groups_now.size() != 2 || groups_now[0].params().size() != 1 || groups_now[1].params().size() != 1 ||
      !torch::equal(groups_now[0].params()[0], bucket1.narrow(0, r * 12, 12)) ||
      !torch::equal(groups_now[1].params()[0], bucket0.narrow(0, r * 8, 8)))
    throw std::runtime_error("rank " + std::to_string(r) + ": the optimizer's chunks are not the "
                             "planned pieces of the buckets");
}

/// A value as text, the same on every LibTorch version.
std::string value_text(const c10::IValue& v) {
  std::ostringstream s;
  if (v.isString()) {
    s << v.toStringRef();
  } else if (v.isBool()) {
    s << (v.toBool() ? "true" : "false");
  } else if (v.isInt()) {
    s << v.toInt();
  } else if (v.isDouble()) {
    s << v.toDouble();
  } else if (v.isTuple()) {
    s << "(";
    const auto& elements = v.toTupleRef().elements();
    for (std::size_t i = 0; i < elements.size(); ++i) s << (i ? ", " : "") << value_text(elements[i]);
    s << ")";
  } else {
    s << v.tagKind();
  }
  return s.str();
}

/// One line per entry of an optimizer archive, in the archive's order: the
/// path of a tensor with its shape and dtype, or of a value with the value.
void describe(torch::serialize::InputArchive& in, const std::string& path, std::vector<std::string>& lines) {
  for (const std::string& key : in.keys()) {
    torch::serialize::InputArchive sub;
    if (in.try_read(key, sub)) {
      describe(sub, path + key + "/", lines);
      continue;
    }
    torch::Tensor t;
    std::ostringstream s;
    if (in.try_read(key, t, false) || in.try_read(key, t, true)) {
      s << path << key << " " << t.sizes() << " " << t.scalar_type();
    } else {
      c10::IValue v;
      in.read(key, v);
      s << path << key << " = " << value_text(v);
    }
    lines.push_back(s.str());
  }
}

/// What pins the layout, sorted: accel's own keys, each group's parameter
/// list and each state's tensors (LibTorch's own bookkeeping is left out: it
/// may differ between versions). The parameters' TensorImpl addresses are
/// replaced by p0, p1, ... in the order the parameter groups list them.
std::string layout_of(const fs::path& file) {
  torch::serialize::InputArchive in;
  in.load_from(file.string());
  std::vector<std::string> lines;
  describe(in, "", lines);
  const std::regex address("(/params/[0-9]+ = |^state/)(0x[0-9a-f]+|[0-9]+)");
  std::map<std::string, std::string> names;
  for (const auto& l : lines)
    if (std::smatch m; l.rfind("state/", 0) != 0 && std::regex_search(l, m, address))
      names.emplace(m[2].str(), "p" + std::to_string(names.size()));
  std::vector<std::string> out;
  for (const auto& l : lines) {
    if (l.rfind("accel.", 0) != 0 && l.rfind("state/", 0) != 0 && l.find("/params/") == std::string::npos)
      continue;
    std::smatch m;
    if (!std::regex_search(l, m, address)) {
      out.push_back(l);
      continue;
    }
    const auto name = names.count(m[2].str()) ? names[m[2].str()] : std::string("p?");
    out.push_back(m.prefix().str() + m[1].str() + name + m.suffix().str());
  }
  std::sort(out.begin(), out.end());
  std::string text;
  for (const auto& l : out) text += l + "\n";
  return text;
}

std::string files_of(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  std::string out;
  for (const auto& n : names) out += n + " ";
  return out;
}

template <class Shard>
void check_layout(const std::string& name, const std::string& expected_rank0,
                  const std::string& expected_rank1) {
  const auto dir = accel_test::scratch("parallel", name) / "ckpt";
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(120);
  accel::notebook_launcher(train_and_save<Shard>, std::make_tuple(dir.string()), lo);
  CHECK(files_of(dir) ==
        "accel_state.json loaders_0.json loaders_1.json model.safetensors optimizer_rank0.pt "
        "optimizer_rank1.pt random_states_0.pt random_states_1.pt ");
  const auto rank0 = layout_of(dir / "optimizer_rank0.pt");
  const auto rank1 = layout_of(dir / "optimizer_rank1.pt");
  INFO("rank 0:\n" << rank0 << "rank 1:\n" << rank1);
  CHECK(rank0 == expected_rank0);
  CHECK(rank1 == expected_rank1);
}

// Each rank's archive: group 0 holds one tensor, its chunk of bucket 1 (12
// values), group 1 its chunk of bucket 0 (8 values); Adam's moments have
// their shapes. Recorded from the code before the gradient-sync redesign.
const char* const kRank = R"(accel.param_groups/0/amsgrad = false
accel.param_groups/0/betas = (0.9, 0.999)
accel.param_groups/0/eps = 1e-08
accel.param_groups/0/lr = 0.01
accel.param_groups/0/weight_decay = 0
accel.param_groups/1/amsgrad = false
accel.param_groups/1/betas = (0.9, 0.999)
accel.param_groups/1/eps = 1e-08
accel.param_groups/1/lr = 0.001
accel.param_groups/1/weight_decay = 0
accel.param_groups/size [] Long
param_groups/param_groups/0/params/0 = p0
param_groups/param_groups/0/params/size [] Long
param_groups/param_groups/1/params/0 = p1
param_groups/param_groups/1/params/size [] Long
state/p0/exp_avg [12] Float
state/p0/exp_avg_sq [12] Float
state/p0/step = 2
state/p1/exp_avg [8] Float
state/p1/exp_avg_sq [8] Float
state/p1/step = 2
)";

}  // namespace

TEST_CASE("the checkpoint layout of sharded optimizers is unchanged", "[parallel][gloo][zero][layout]") {
  SECTION("ShardOptimizer") {
    check_layout<accel::shard::ShardOptimizer>("layout_zero1", kRank, kRank);
  }
  SECTION("ShardGradients") {
    check_layout<accel::shard::ShardGradients>("layout_zero2", kRank, kRank);
  }
}
