// Object collectives (gather_object, broadcast_object), split_between_processes
// with gather_for_metrics, the trigger and find_executable_batch_size: the
// encoding and the splitting alone, then on 2 and 3 real Gloo processes
// forked by accel's own launcher.
#include <accel/accel.hpp>
#include <accel/launch/notebook_launcher.hpp>

#include <cmath>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "catch.hpp"

#include "workers.hpp"

namespace demo {
// A user type with nlohmann's to_json/from_json, found by ADL.
struct Score {
  std::string name;
  double value = 0;
  bool operator==(const Score&) const = default;
};
inline void to_json(nlohmann::json& j, const Score& s) { j = {{"name", s.name}, {"value", s.value}}; }
inline void from_json(const nlohmann::json& j, Score& s) {
  j.at("name").get_to(s.name);
  j.at("value").get_to(s.value);
}
}  // namespace demo

namespace {

using accel_test::expect;

template <class T>
T round_trip(const T& v) {
  const auto bytes = accel::ops::to_bytes(v);
  return accel::ops::from_bytes<T>(bytes.data(), bytes.size());
}

// Rank k's values, computed the same way by every rank (the reference).
using Nested = std::vector<std::vector<int>>;
Nested nested_of(int k) {
  Nested v;
  for (int i = 0; i <= k; ++i) v.push_back(std::vector<int>(static_cast<std::size_t>(i + 1), k * 10 + i));
  return v;
}
std::map<std::string, std::optional<int64_t>> map_of(int k) {
  std::map<std::string, std::optional<int64_t>> m{{"rank", k}, {"none", std::nullopt}};
  if (k % 2 == 1) m["odd"] = int64_t{1} << 40;
  return m;
}
torch::Tensor tensor_of(int k, torch::ScalarType dtype) {
  // Ragged: rank k has k + 1 rows and a rank-dependent last dimension.
  return torch::arange((k + 1) * (k + 2)).reshape({k + 1, k + 2}).to(dtype);
}
const std::vector<torch::ScalarType> kDtypes = {torch::kFloat, torch::kDouble, torch::kHalf,  torch::kBFloat16,
                                                torch::kLong,  torch::kInt,    torch::kByte,  torch::kBool,
                                                torch::kComplexFloat};

void objects_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  const int r = acc.process_index(), n = acc.num_processes();
  const std::string who = "rank " + std::to_string(r) + ": ";

  auto ints = acc.gather_object(r * 7 - 3);
  expect(ints.size() == static_cast<std::size_t>(n), who + "one element per rank");
  for (int k = 0; k < n; ++k) expect(ints[static_cast<std::size_t>(k)] == k * 7 - 3, who + "int in rank order");

  auto doubles = acc.gather_object(1.0 / (r + 3));
  for (int k = 0; k < n; ++k) expect(doubles[static_cast<std::size_t>(k)] == 1.0 / (k + 3), who + "double exact");

  auto strings = acc.gather_object(std::string(static_cast<std::size_t>(r * 50), static_cast<char>('a' + r)));
  for (int k = 0; k < n; ++k)
    expect(strings[static_cast<std::size_t>(k)] == std::string(static_cast<std::size_t>(k * 50), static_cast<char>('a' + k)),
           who + "ragged strings");

  auto nested = acc.gather_object(nested_of(r));
  for (int k = 0; k < n; ++k) expect(nested[static_cast<std::size_t>(k)] == nested_of(k), who + "nested vectors keep structure");

  auto maps = acc.gather_object(map_of(r));
  for (int k = 0; k < n; ++k) expect(maps[static_cast<std::size_t>(k)] == map_of(k), who + "map of optionals");

  using Tup = std::tuple<int, std::string, std::pair<bool, float>>;
  auto tuples = acc.gather_object(Tup{r, std::to_string(r), {r == 0, 0.5f * r}});
  for (int k = 0; k < n; ++k)
    expect(tuples[static_cast<std::size_t>(k)] == Tup{k, std::to_string(k), {k == 0, 0.5f * k}}, who + "tuple/pair");

  auto jsons = acc.gather_object(nlohmann::json{{"rank", r}, {"list", nlohmann::json::array({r, "x"})}});
  for (int k = 0; k < n; ++k)
    expect(jsons[static_cast<std::size_t>(k)] == nlohmann::json{{"rank", k}, {"list", nlohmann::json::array({k, "x"})}},
           who + "nlohmann::json");

  auto scores = acc.gather_object(demo::Score{"r" + std::to_string(r), r + 0.25});
  for (int k = 0; k < n; ++k)
    expect(scores[static_cast<std::size_t>(k)] == demo::Score{"r" + std::to_string(k), k + 0.25}, who + "to_json/from_json type");

  for (auto dtype : kDtypes) {
    auto all = acc.gather_object(tensor_of(r, dtype));
    for (int k = 0; k < n; ++k) {
      const auto& t = all[static_cast<std::size_t>(k)];
      expect(t.scalar_type() == dtype && torch::equal(t, tensor_of(k, dtype)),
             who + "ragged tensor of " + std::string(c10::toString(dtype)) + " from rank " + std::to_string(k));
    }
  }
  auto tensor_lists = acc.gather_object(std::vector<torch::Tensor>(static_cast<std::size_t>(r), torch::full({2}, r)));
  for (int k = 0; k < n; ++k) {
    const auto& l = tensor_lists[static_cast<std::size_t>(k)];
    expect(l.size() == static_cast<std::size_t>(k), who + "vector<Tensor> length");
    for (const auto& t : l) expect(torch::equal(t, torch::full({2}, k)), who + "vector<Tensor> values");
  }

  // broadcast_object: from the last rank, then from 0; the others' own values are replaced.
  auto from_last = acc.broadcast_object(map_of(r), n - 1);
  expect(from_last == map_of(n - 1), who + "broadcast_object from the last rank");
  auto from_main = acc.broadcast_object(std::make_pair(std::string(r == 0 ? "main" : "other"), tensor_of(r, torch::kFloat)));
  expect(from_main.first == "main" && torch::equal(from_main.second, tensor_of(0, torch::kFloat)),
         who + "broadcast_object of a pair with a tensor");

  // gather_for_metrics with dim 0 differing across ranks: rank k has k + 1 rows of value k.
  auto ragged = acc.gather_for_metrics(torch::full({r + 1, 3}, static_cast<float>(r)));
  std::vector<torch::Tensor> want;
  for (int k = 0; k < n; ++k) want.push_back(torch::full({k + 1, 3}, static_cast<float>(k)));
  expect(torch::equal(ragged, torch::cat(want)), who + "gather_for_metrics of ragged rows");
}

// Every rank splits 1..7 items, with and without padding, as a vector and as
// a tensor; gather_for_metrics of the parts gives back the input exactly.
void split_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  const int r = acc.process_index(), n = acc.num_processes();
  for (int64_t items = 1; items <= 7; ++items) {
    for (bool pad : {false, true}) {
      const std::string what = "rank " + std::to_string(r) + ", " + std::to_string(items) + " items" +
                               (pad ? " padded" : "") + ": ";
      std::vector<std::string> words;
      for (int64_t i = 0; i < items; ++i) words.push_back(accel::detail::concat("w", i));
      auto mine = acc.split_between_processes(words, pad);
      const int64_t base = items / n, extra = items % n;
      const int64_t expected = pad ? (items + n - 1) / n : base + (r < extra ? 1 : 0);
      expect(static_cast<int64_t>(mine.size()) == expected, what + "share size");
      auto back = acc.gather_for_metrics(mine);
      expect(back == words, what + "vector round trip");

      auto rows = torch::arange(items * 2).reshape({items, 2});
      auto part = acc.split_between_processes(rows, pad);
      expect(part.size(0) == expected, what + "tensor share size");
      expect(torch::equal(acc.gather_for_metrics(part * 10), rows * 10), what + "tensor round trip");
    }
  }
}

// A dataset whose items are their own index.
struct Indices : torch::data::datasets::Dataset<Indices> {
  int64_t n;
  explicit Indices(int64_t size) : n(size) {}
  torch::data::Example<> get(size_t i) override {
    auto t = torch::tensor({static_cast<int64_t>(i)});
    return {t, t};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(n); }
};

// gather_for_metrics of vectors over an epoch: every item exactly once, even
// though even_batches repeated items on the last batch.
void vector_metrics_body(int64_t dataset_size, int64_t batch) {
  accel::Accelerator<accel::backend::Gloo> acc;
  auto loader = accel::data::make_data_loader(Indices(dataset_size), accel::data::LoaderOptions{.batch_size = batch});
  auto [dl] = acc.prepare(loader);
  std::vector<int64_t> seen;
  for (auto& b : dl) {
    auto ids = b.data.view(-1);
    std::vector<std::string> mine;
    for (int64_t k = 0; k < ids.size(0); ++k) mine.push_back("item " + std::to_string(ids[k].item<int64_t>()));
    for (auto& s : acc.gather_for_metrics(mine)) seen.push_back(std::stoll(s.substr(5)));
  }
  std::vector<int64_t> expected;
  for (int64_t i = 0; i < dataset_size; ++i) expected.push_back(i);
  expect(seen == expected, "gather_for_metrics(vector) saw " + std::to_string(seen.size()) + " items");
}

// Rank `setter` sets the trigger before check number 3 only: every rank sees
// it at check 3, at no other, and it is cleared after it was seen.
void trigger_body(int setter) {
  accel::Accelerator<accel::backend::Gloo> acc;
  std::vector<int> seen;
  for (int step = 0; step < 6; ++step) {
    if (step == 3 && acc.process_index() == setter) {
      acc.set_trigger();
      acc.set_trigger();  // twice before a check: still one event
    }
    if (acc.check_trigger()) seen.push_back(step);
  }
  expect(seen == std::vector<int>{3}, "rank " + std::to_string(acc.process_index()) + " saw the trigger at " +
                                          std::to_string(seen.size()) + " checks");
}

// on_main_process & co. run on the right ranks only and hand back fn's result.
void on_process_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  std::string ran;
  acc.on_main_process([&] { ran += "main "; });
  acc.on_local_main_process([&] { ran += "local_main "; });
  acc.on_last_process([&] { ran += "last "; });
  auto one = acc.on_process(1, [&] { ran += "one "; return 42; });
  const int r = acc.process_index(), n = acc.num_processes();
  std::string want = std::string(r == 0 ? "main local_main " : "") + (r == n - 1 ? "last " : "") + (r == 1 ? "one " : "");
  expect(ran == want, "rank " + std::to_string(r) + " ran: " + ran);
  expect(one == (r == 1 ? std::optional<int>(42) : std::nullopt), "on_process result");
  bool threw = false;
  try {
    acc.on_process(n, [] {});
  } catch (const accel::Error&) {
    threw = true;
  }
  expect(threw, "on_process(n) is an error");
}

// Rank r runs out of memory above its own threshold (thresholds differ by
// rank); every rank must try the same sizes and end on the same one.
void batch_size_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  const int r = acc.process_index();
  const int64_t threshold = std::vector<int64_t>{100, 60, 80}[static_cast<std::size_t>(r)];
  std::vector<int64_t> tried;
  const int64_t found = acc.find_executable_batch_size(
      [&](int64_t bs) {
        tried.push_back(bs);
        if (bs > threshold) throw std::bad_alloc();
        return bs;
      },
      128);
  // 128, int(128 * 0.9) = 115, 103, 92, 82, 73, 65, 58: the first <= the smallest threshold.
  const int64_t smallest = 60;  // rank 1's threshold, the lowest of 2 and of 3 ranks
  std::vector<int64_t> expected;
  for (int64_t s = 128;; s = static_cast<int64_t>(static_cast<double>(s) * 0.9)) {
    expected.push_back(s);
    if (s <= smallest) break;
  }
  expect(found == 58 && tried == expected,
         "rank " + std::to_string(r) + " ended at " + std::to_string(found) + " after " + std::to_string(tried.size()) + " tries");
  auto all = acc.gather_object(tried);
  for (const auto& t : all) expect(t == tried, "ranks tried different sizes");
}

// A non-memory error on rank 1 stops every rank (no hang); the launch names
// rank 1 and its message.
void batch_size_error_body() {
  accel::Accelerator<accel::backend::Gloo> acc;
  acc.find_executable_batch_size(
      [&](int64_t bs) {
        if (bs < 100 && acc.process_index() == 1) throw std::runtime_error("bad input file");
        if (bs >= 100) throw std::bad_alloc();
      },
      128);
}

}  // namespace

TEST_CASE("object encoding keeps values, types and structure", "[objects][encoding]") {
  CHECK((round_trip(int64_t{-5}) == -5));
  CHECK((round_trip(std::numeric_limits<uint64_t>::max()) == std::numeric_limits<uint64_t>::max()));
  CHECK((round_trip(std::numeric_limits<int64_t>::min()) == std::numeric_limits<int64_t>::min()));
  CHECK((round_trip(0.1f) == 0.1f));
  CHECK(std::isnan(round_trip(std::nan(""))));
  CHECK((round_trip(-std::numeric_limits<double>::infinity()) == -std::numeric_limits<double>::infinity()));
  CHECK((round_trip(true) == true));
  const char raw[] = "not utf-8: \xff\xfe and a \0 byte";
  const std::string odd(raw, sizeof raw - 1);
  CHECK((round_trip(odd) == odd));
  CHECK((round_trip(std::vector<bool>{true, false, true}) == std::vector<bool>{true, false, true}));
  CHECK((round_trip(nested_of(3)) == nested_of(3)));
  CHECK(round_trip(std::vector<Nested>{}).empty());
  CHECK((round_trip(map_of(1)) == map_of(1)));
  std::map<int, std::vector<std::string>> by_int{{-1, {"a", "b"}}, {7, {}}};
  CHECK((round_trip(by_int) == by_int));
  CHECK((round_trip(std::optional<std::string>{}) == std::nullopt));
  CHECK((round_trip(std::make_tuple(1, std::string("x"), std::make_pair(2.5, 'c'))) ==
        std::make_tuple(1, std::string("x"), std::make_pair(2.5, 'c'))));
  CHECK((round_trip(demo::Score{"acc", 0.75}) == demo::Score{"acc", 0.75}));
  CHECK((round_trip(std::vector<demo::Score>{{"a", 1}, {"b", 2}}) == std::vector<demo::Score>{{"a", 1}, {"b", 2}}));
  for (auto dtype : kDtypes) {
    auto t = tensor_of(2, dtype);
    auto back = round_trip(t);
    CHECK(back.scalar_type() == dtype);
    CHECK(torch::equal(back, t));
  }
  auto strided = torch::arange(12).reshape({3, 4}).t();  // not contiguous
  CHECK(torch::equal(round_trip(strided), strided));
  CHECK(round_trip(torch::empty({0, 5})).sizes() == torch::IntArrayRef{0, 5});
  CHECK(round_trip(torch::tensor(3.5)).dim() == 0);
  CHECK_FALSE(round_trip(torch::Tensor()).defined());
  CHECK_THROWS_WITH(round_trip(torch::eye(2).to_sparse()),
                    Catch::Matchers::ContainsSubstring("sends dense tensors only"));
  // Decoding as another type than was sent is an error that says so.
  const auto bytes = accel::ops::to_bytes(std::string("x"));
  CHECK_THROWS_WITH(accel::ops::from_bytes<std::vector<int>>(bytes.data(), bytes.size()),
                    Catch::Matchers::ContainsSubstring("Call it with the same type on every rank"));
}

TEST_CASE("split_between_processes: contiguous, balanced, padding dropped again (0..7 items, 1..4 ranks)",
          "[objects][split]") {
  for (int64_t items = 0; items <= 7; ++items) {
    for (int world = 1; world <= 4; ++world) {
      INFO(items << " items, " << world << " ranks");
      std::vector<int> v;
      for (int i = 0; i < items; ++i) v.push_back(i);
      auto rows = torch::arange(items * 3).reshape({items, 3});
      std::vector<int> joined, joined_padded;
      std::vector<torch::Tensor> parts_padded;
      int64_t smallest = items, largest = 0;
      for (int r = 0; r < world; ++r) {
        auto part = accel::ops::split_between_processes(v, r, world);
        smallest = std::min<int64_t>(smallest, static_cast<int64_t>(part.size()));
        largest = std::max<int64_t>(largest, static_cast<int64_t>(part.size()));
        joined.insert(joined.end(), part.begin(), part.end());
        CHECK(torch::equal(accel::ops::split_between_processes(rows, r, world),
                           torch::tensor(std::vector<int64_t>(part.begin(), part.end()), torch::kLong).reshape({-1, 1}) * 3 +
                               torch::arange(3)));
        auto padded = accel::ops::split_between_processes(v, r, world, true);
        CHECK(static_cast<int64_t>(padded.size()) == (items + world - 1) / world);
        for (std::size_t i = part.size(); i < padded.size(); ++i)  // the last item repeated
          CHECK(padded[i] == (part.empty() ? v.back() : part.back()));
        joined_padded.insert(joined_padded.end(), padded.begin(), padded.end());
        auto tpadded = accel::ops::split_between_processes(rows, r, world, true);
        CHECK(tpadded.size(0) == static_cast<int64_t>(padded.size()));
        if (!padded.empty()) CHECK(torch::equal(tpadded.select(1, 0), torch::tensor(std::vector<int64_t>(padded.begin(), padded.end())) * 3));
        parts_padded.push_back(tpadded);
      }
      CHECK(joined == v);  // contiguous, in rank order, nothing lost
      CHECK(largest - smallest <= 1);
      CHECK(accel::ops::drop_split_padding(joined_padded, items, world) == v);
      CHECK(torch::equal(accel::ops::drop_split_padding(torch::cat(parts_padded), items, world), rows));
    }
  }
  CHECK_THROWS_WITH(accel::ops::split_between_processes(torch::tensor(1.0), 0, 2),
                    Catch::Matchers::ContainsSubstring("got a 0-d or undefined tensor"));
}

TEST_CASE("gather_object / broadcast_object on 2 and 3 Gloo processes", "[parallel][gloo][objects]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(objects_body, std::make_tuple(), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(objects_body, std::make_tuple(), accel_test::local_processes(3)));
}

TEST_CASE("split_between_processes and gather_for_metrics round trip on 2 and 3 processes", "[parallel][gloo][split]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(split_body, std::make_tuple(), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(split_body, std::make_tuple(), accel_test::local_processes(3)));
}

TEST_CASE("gather_for_metrics of vectors drops the loader's wrap-around duplicates", "[parallel][gloo][metrics]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(vector_metrics_body, std::make_tuple(int64_t{10}, int64_t{3}), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(vector_metrics_body, std::make_tuple(int64_t{11}, int64_t{2}), accel_test::local_processes(3)));
}

TEST_CASE("set_trigger on one rank is seen by every rank at the next check, once", "[parallel][gloo][trigger]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(trigger_body, std::make_tuple(1), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(trigger_body, std::make_tuple(2), accel_test::local_processes(3)));
  REQUIRE_NOTHROW(accel::notebook_launcher(trigger_body, std::make_tuple(0), accel_test::local_processes(3)));
}

TEST_CASE("on_main_process, on_local_main_process, on_last_process, on_process", "[parallel][gloo][on_process]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(on_process_body, std::make_tuple(), accel_test::local_processes(3)));
}

TEST_CASE("find_executable_batch_size: every rank on the same size", "[parallel][gloo][batch_size]") {
  REQUIRE_NOTHROW(accel::notebook_launcher(batch_size_body, std::make_tuple(), accel_test::local_processes(2)));
  REQUIRE_NOTHROW(accel::notebook_launcher(batch_size_body, std::make_tuple(), accel_test::local_processes(3)));
  try {
    accel::notebook_launcher(batch_size_error_body, std::make_tuple(), accel_test::local_processes(3));
    FAIL("the launch succeeded");
  } catch (const accel::LaunchError& e) {
    CHECK(e.rank() == 1);
    CHECK_THAT(std::string(e.what()), Catch::Matchers::ContainsSubstring("bad input file"));
  }
}

TEST_CASE("find_executable_batch_size in one process: LibTorch's CPU allocation failure, bad_alloc, other errors",
          "[objects][batch_size]") {
  std::vector<int64_t> tried;
  // Above 40 the function asks LibTorch's CPU allocator for 1 PiB: a real allocation failure.
  auto result = accel::find_executable_batch_size(
      [&](int64_t bs) {
        tried.push_back(bs);
        auto t = torch::empty({bs > 40 ? int64_t{1} << 50 : 1024}, torch::kByte);
        return std::make_pair(bs, t.numel());
      },
      64);
  CHECK(result == std::make_pair(int64_t{40}, int64_t{1024}));
  CHECK(tried == std::vector<int64_t>{64, 57, 51, 45, 40});

  int calls = 0;
  accel::find_executable_batch_size([&](int64_t bs) { ++calls; if (bs > 3) throw std::bad_alloc(); }, 5);
  CHECK(calls == 3);  // 5, 4, 3

  calls = 0;
  CHECK_THROWS_WITH(accel::find_executable_batch_size([&](int64_t) -> int { ++calls; throw std::runtime_error("not memory"); }, 64),
                    "not memory");
  CHECK(calls == 1);  // not retried

  CHECK_THROWS_WITH(accel::find_executable_batch_size([](int64_t) -> int { throw std::bad_alloc(); }, 3),
                    Catch::Matchers::ContainsSubstring("found no batch size that fits"));
}

namespace {
// A 2-rank communicator on the meta device that stops every collective with
// a known message once its tensors are on that device (as NCCL needs CUDA
// tensors): the helper tensors of these functions must be made on device().
class MetaCommunicator final : public accel::runtime::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  std::string_view backend_name() const override { return "Meta"; }
  torch::Device device() const override { return torch::kMeta; }
  std::shared_ptr<accel::runtime::Work> all_reduce(torch::Tensor& t, accel::runtime::ReduceOp) override { return reached(t, t); }
  std::shared_ptr<accel::runtime::Work> all_gather(torch::Tensor& out, const torch::Tensor& in) override { return reached(out, in); }
  std::shared_ptr<accel::runtime::Work> reduce_scatter(torch::Tensor& out, const torch::Tensor& in,
                                                       accel::runtime::ReduceOp) override {
    return reached(out, in);
  }
  std::shared_ptr<accel::runtime::Work> broadcast(torch::Tensor& t, int) override { return reached(t, t); }
  void barrier() override {}

 private:
  std::shared_ptr<accel::runtime::Work> reached(const torch::Tensor& a, const torch::Tensor& b) {
    if (a.device() != device() || b.device() != device())
      throw std::runtime_error("collective got a tensor on " + a.device().str() + "/" + b.device().str());
    throw std::runtime_error("collective reached on the communicator's device");
  }
};
}  // namespace

TEST_CASE("object collectives, trigger and batch-size search make their tensors on the communicator's device",
          "[objects][device]") {
  MetaCommunicator comm;
  const auto reached = Catch::Matchers::ContainsSubstring("reached on the communicator's device");
  CHECK_THROWS_WITH(accel::ops::gather_object(comm, std::string("x")), reached);
  CHECK_THROWS_WITH(accel::ops::broadcast_object(comm, std::string("x")), reached);
  CHECK_THROWS_WITH(accel::ops::gather_ragged(comm, torch::ones({3}).to(torch::kMeta)), reached);
  accel::ops::Trigger trigger;
  CHECK_THROWS_WITH(trigger.check(comm), reached);
  CHECK_THROWS_WITH(accel::ops::find_executable_batch_size(comm, [](int64_t bs) { return bs; }, 8), reached);
}

TEST_CASE("one process (SingleDevice): the same calls work with world size 1", "[objects][single]") {
  accel::Accelerator<> acc;
  auto one = acc.gather_object(std::map<int, std::string>{{1, "a"}});
  REQUIRE(one.size() == 1);
  CHECK((one[0] == std::map<int, std::string>{{1, "a"}}));
  CHECK(acc.broadcast_object(std::string("kept")) == "kept");
  std::vector<int> v{1, 2, 3};
  CHECK(acc.split_between_processes(v, true) == v);
  CHECK(acc.gather_for_metrics(v) == v);
  CHECK(torch::equal(acc.gather_for_metrics(torch::arange(5)), torch::arange(5)));
  CHECK_FALSE(acc.check_trigger());
  acc.set_trigger();
  CHECK(acc.check_trigger());
  CHECK_FALSE(acc.check_trigger());
  CHECK(acc.find_executable_batch_size([](int64_t bs) { if (bs > 7) throw std::bad_alloc(); return bs; }, 10) == 7);
  CHECK((acc.on_main_process([] { return 1; }) == std::optional<int>(1)));
}
