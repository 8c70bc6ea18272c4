// DataLoader behaviour: collate, device placement, worker threads, the
// active-loader state and resuming an interrupted epoch.
#include "test_data_support.hpp"

#include "catch.hpp"

#include <atomic>
#include <barrier>
#include <map>
#include <chrono>
#include <stdexcept>
#include <thread>

using accel::data::LoaderCheckpoint;
using accel::data::LoaderOptions;
using accel::data::make_data_loader;
using accel::data::ShardSpec;
using accel_test::Batches;
using accel_test::collect;
using accel_test::IndexDataset;
using accel_test::to_vec;

namespace {

// A dataset that is not a torch::data::Dataset: plain tensors, integer size.
struct TensorsOnly {
  torch::Tensor get(size_t i) { return torch::full({2}, static_cast<double>(i)); }
  size_t size() const { return 5; }
};

// Sleeps a pseudo-random time per sample (so workers finish out of order)
// and throws at one index when asked to.
struct SlowDataset : torch::data::datasets::Dataset<SlowDataset> {
  SlowDataset(size_t n, int64_t throw_at = -1, int max_sleep_us = 300)
      : n(n), throw_at(throw_at), max_sleep_us(max_sleep_us) {}
  torch::data::Example<> get(size_t i) override {
    if (max_sleep_us > 0)
      std::this_thread::sleep_for(std::chrono::microseconds((i * 7919) % max_sleep_us));
    if (static_cast<int64_t>(i) == throw_at) throw std::runtime_error("bad sample " + std::to_string(i));
    return {torch::tensor(static_cast<int64_t>(i)), torch::tensor(static_cast<int64_t>(10 * i))};
  }
  torch::optional<size_t> size() const override { return n; }
  size_t n;
  int64_t throw_at;
  int max_sleep_us;
};

struct Movable {
  torch::Tensor x;
  std::vector<std::string> moved_to;
  Movable to(const torch::Device& d) const {
    Movable m{x.to(d), moved_to};
    m.moved_to.push_back(d.str());
    return m;
  }
};

}  // namespace

TEST_CASE("default collate stacks data and target", "[data][collate]") {
  auto loader = make_data_loader(IndexDataset(5), LoaderOptions{.batch_size = 2});
  std::vector<torch::data::Example<>> seen;
  for (auto& batch : loader) seen.push_back(batch);
  REQUIRE(seen.size() == 3);
  CHECK(seen[0].data.sizes() == torch::IntArrayRef{2});
  CHECK(to_vec(seen[1].data) == std::vector<int64_t>{2, 3});
  CHECK(to_vec(seen[1].target) == std::vector<int64_t>{20, 30});
  CHECK(to_vec(seen[2].target) == std::vector<int64_t>{40});
  CHECK(loader.size() == 3);
  CHECK(loader.dataset_size() == 5);
  CHECK(loader.batch_size() == 2);

  SECTION("plain tensors, integer size()") {
    auto plain = make_data_loader(TensorsOnly{}, LoaderOptions{.batch_size = 4});
    static_assert(std::is_same_v<decltype(plain)::batch_type, torch::Tensor>);
    std::vector<torch::Tensor> batches;
    for (auto& b : plain) batches.push_back(b);
    REQUIRE(batches.size() == 2);
    CHECK(batches[0].sizes() == torch::IntArrayRef{4, 2});
    CHECK(batches[1][0][1].item<double>() == 4.0);
  }
  SECTION("TensorExample (no target) and shared_ptr datasets") {
    auto ds = std::make_shared<torch::data::datasets::TensorDataset>(torch::arange(6).view({6, 1}));
    auto loader2 = make_data_loader(ds, LoaderOptions{.batch_size = 4});
    static_assert(std::is_same_v<decltype(loader2)::batch_type, torch::data::TensorExample>);
    CHECK(&loader2.dataset() == ds.get());
    std::vector<torch::Tensor> batches;
    for (auto& b : loader2) batches.push_back(b.data);
    REQUIRE(batches.size() == 2);
    CHECK(batches[0].sizes() == torch::IntArrayRef{4, 1});
    CHECK(to_vec(batches[1]) == std::vector<int64_t>{4, 5});
  }
  SECTION("a dataset.map(Stack<>()) is asked for whole batches") {
    auto mapped = make_data_loader(IndexDataset(5).map(torch::data::transforms::Stack<>()),
                                   LoaderOptions{.batch_size = 2, .shuffle = true, .seed = 3});
    auto reference = make_data_loader(IndexDataset(5), LoaderOptions{.batch_size = 2, .shuffle = true, .seed = 3});
    CHECK(collect(mapped) == collect(reference));
  }
}

TEST_CASE("custom collate", "[data][collate]") {
  auto loader = make_data_loader(
      IndexDataset(7), LoaderOptions{.batch_size = 3, .num_workers = 2},
      [](std::vector<torch::data::Example<>> samples) {
        std::vector<int64_t> ids;
        for (auto& s : samples) ids.push_back(s.data.item<int64_t>() * 100);
        return ids;
      });
  static_assert(std::is_same_v<decltype(loader)::batch_type, std::vector<int64_t>>);
  Batches got;
  for (auto& ids : loader) got.push_back(ids);
  CHECK(got == Batches{{0, 100, 200}, {300, 400, 500}, {600}});
}

TEST_CASE("to_device and set_device", "[data][device]") {
  const torch::Device cpu(torch::kCPU);
  auto t = torch::ones({2});
  auto tup = accel::data::to_device(std::make_tuple(t, std::vector<torch::Tensor>{t, t}, 3, std::string("s")), cpu);
  CHECK(std::get<0>(tup).device() == cpu);
  CHECK(std::get<1>(tup).size() == 2);
  CHECK(std::get<2>(tup) == 3);
  auto pr = accel::data::to_device(std::make_pair(torch::data::Example<>(t, t), std::optional<torch::Tensor>(t)), cpu);
  CHECK(pr.first.target.device() == cpu);
  Movable m = accel::data::to_device(Movable{t, {}}, cpu);
  CHECK(m.moved_to == std::vector<std::string>{"cpu"});

  auto loader = make_data_loader(IndexDataset(4), LoaderOptions{.batch_size = 2, .num_workers = 1},
                                 [](std::vector<torch::data::Example<>> s) {
                                   return Movable{torch::stack({s[0].data, s[1].data}), {}};
                                 });
  CHECK_FALSE(loader.device().has_value());
  loader.set_device(cpu);
  REQUIRE(loader.device() == cpu);
  int n = 0;
  for (auto& b : loader) {
    CHECK(b.moved_to == std::vector<std::string>{"cpu"});  // moved exactly once, on the way out
    CHECK(b.x.device() == cpu);
    ++n;
  }
  CHECK(n == 2);
  CHECK(loader.sharded(ShardSpec{0, 2}).device() == cpu);
}

TEST_CASE("num_workers > 0 yields the same batches in the same order", "[data][workers]") {
  for (int workers : {1, 2, 3}) {
    for (int world : {1, 2}) {
      auto seq = make_data_loader(SlowDataset(37), LoaderOptions{.batch_size = 4, .shuffle = true, .seed = 11})
                     .sharded(ShardSpec{world - 1, world});
      auto par = make_data_loader(SlowDataset(37), LoaderOptions{.batch_size = 4, .shuffle = true,
                                                                 .num_workers = workers, .seed = 11,
                                                                 .prefetch_factor = 1})
                     .sharded(ShardSpec{world - 1, world});
      for (int epoch = 0; epoch < 3; ++epoch) {
        INFO("workers=" << workers << " world=" << world << " epoch=" << epoch);
        const auto a = collect(seq);
        const auto b = collect(par);
        CHECK(a == b);
        CHECK(static_cast<int64_t>(b.size()) == par.size());
      }
      CHECK(par.epoch() == 3);
    }
  }
}

TEST_CASE("a worker's exception reaches the consumer at its batch", "[data][workers]") {
  for (int workers : {0, 2}) {
    INFO("workers=" << workers);
    auto loader = make_data_loader(SlowDataset(20, 7), LoaderOptions{.batch_size = 2, .num_workers = workers});
    Batches got;
    auto consume = [&] {
      for (auto& b : loader) got.push_back(to_vec(b.data));
    };
    CHECK_THROWS_WITH(consume(), "bad sample 7");
    CHECK(got == Batches{{0, 1}, {2, 3}, {4, 5}});  // batch 3 holds index 7
    CHECK(accel::data::active_loader_state() == nullptr);
    CHECK(loader.epoch() == 0);  // an interrupted epoch does not advance
  }
}

TEST_CASE("leaving a loop early with workers stops them", "[data][workers]") {
  const auto start = std::chrono::steady_clock::now();
  for (int rep = 0; rep < 20; ++rep) {
    auto loader = make_data_loader(SlowDataset(1000, -1, 1000),
                                   LoaderOptions{.batch_size = 4, .num_workers = 3, .prefetch_factor = 4});
    int n = 0;
    for (auto& b : loader) {
      CHECK(b.data.size(0) == 4);
      if (++n == 2) break;
    }
    CHECK(loader.batches_yielded() == 2);
    CHECK(accel::data::active_loader_state() == nullptr);
  }
  // 20 loops, each stops after at most the 12 batches in flight (~4 ms each).
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));

  SECTION("a dataset slower than the timeout is an accel::Error, not a hang") {
    struct Sleepy {
      torch::Tensor get(size_t) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return torch::zeros({1});
      }
      size_t size() const { return 2; }
    };
    auto sleepy = make_data_loader(Sleepy{}, LoaderOptions{.batch_size = 1, .num_workers = 1,
                                                          .timeout = std::chrono::milliseconds(50)});
    auto consume = [&] {
      for (auto& b : sleepy) (void)b;
    };
    CHECK_THROWS_WITH(consume(), Catch::Matchers::ContainsSubstring("accel: a data loader worker took more than 50 ms"));
  }
}

TEST_CASE("active_loader_state tracks the innermost loop and its last batch", "[data][state]") {
  CHECK(accel::data::active_loader_state() == nullptr);
  auto train = make_data_loader(IndexDataset(10), LoaderOptions{.batch_size = 3}).sharded(ShardSpec{1, 2});
  auto eval = make_data_loader(IndexDataset(5), LoaderOptions{.batch_size = 2, .num_workers = 2});
  std::vector<bool> ends;
  int64_t i = 0;
  for (auto& batch : train) {
    const auto* s = accel::data::active_loader_state();
    REQUIRE(s != nullptr);
    ends.push_back(s->end_of_dataloader);
    CHECK(s->remainder == 4);
    CHECK(s->batch_index == i);
    CHECK(s->num_batches == 2);
    if (s->end_of_dataloader) CHECK(to_vec(batch.data) == std::vector<int64_t>{9, 0, 1});
    // A nested (evaluation) loop is active while it runs, then the outer again.
    std::vector<bool> eval_ends;
    for (auto& eb : eval) {
      (void)eb;
      const auto* e = accel::data::active_loader_state();
      REQUIRE(e != nullptr);
      CHECK(e != s);
      CHECK(e->remainder == 1);
      eval_ends.push_back(e->end_of_dataloader);
    }
    CHECK(eval_ends == std::vector<bool>{false, false, true});
    CHECK(accel::data::active_loader_state() == s);
    for (auto& eb : eval) {  // left early: the outer loop is active again
      (void)eb;
      break;
    }
    CHECK(accel::data::active_loader_state() == s);
    ++i;
  }
  CHECK(ends == std::vector<bool>{false, true});
  CHECK(accel::data::active_loader_state() == nullptr);

  auto dropping = make_data_loader(IndexDataset(10), LoaderOptions{.batch_size = 3, .drop_last = true});
  for (auto& b : dropping) {
    (void)b;
    CHECK(accel::data::active_loader_state()->remainder == 0);
  }
}

TEST_CASE("skip_first_batches and checkpoint/restore continue exactly", "[data][resume]") {
  const LoaderOptions opts{.batch_size = 2, .shuffle = true, .seed = 5};
  auto reference = make_data_loader(IndexDataset(11), opts).sharded(ShardSpec{0, 2});
  std::vector<Batches> epochs;
  for (int e = 0; e < 3; ++e) epochs.push_back(collect(reference));
  REQUIRE(epochs[1].size() == 3);
  REQUIRE(epochs[0] != epochs[1]);

  SECTION("skip_first_batches skips only in its first loop") {
    auto loader = make_data_loader(IndexDataset(11), opts).sharded(ShardSpec{0, 2});
    loader.set_epoch(1);
    auto skipped = loader.skip_first_batches(2);
    CHECK(skipped.batches_yielded() == 2);
    Batches got;
    std::vector<int64_t> positions;
    for (auto& b : skipped) {
      got.push_back(to_vec(b.data));
      positions.push_back(skipped.batches_yielded());
      CHECK(accel::data::active_loader_state()->end_of_dataloader);
    }
    CHECK(got == Batches(epochs[1].begin() + 2, epochs[1].end()));
    CHECK(positions == std::vector<int64_t>{3});
    CHECK(skipped.epoch() == 2);
    CHECK(collect(skipped) == epochs[2]);  // the next epoch is whole
    CHECK(collect(loader) == epochs[1]);   // the original is untouched
    auto past_end = loader.skip_first_batches(10);
    CHECK(collect(past_end).empty());
  }

  for (int workers : {0, 2}) {
    SECTION("checkpoint mid-epoch, restore in a fresh loader, workers=" + std::to_string(workers)) {
      LoaderOptions o = opts;
      o.num_workers = workers;
      auto loader = make_data_loader(IndexDataset(11), o).sharded(ShardSpec{0, 2});
      Batches seen = collect(loader);  // epoch 0
      LoaderCheckpoint ck{};
      for (auto& b : loader) {  // epoch 1, interrupted after its first batch
        seen.push_back(to_vec(b.data));
        ck = loader.checkpoint();
        break;
      }
      CHECK(ck.epoch == 1);
      CHECK(ck.batches_yielded == 1);
      auto resumed = make_data_loader(IndexDataset(11), o).sharded(ShardSpec{0, 2});
      resumed.restore(ck);
      CHECK(resumed.checkpoint().epoch == 1);
      CHECK(resumed.checkpoint().batches_yielded == 1);
      for (int e = 0; e < 2; ++e) {
        auto more = collect(resumed);
        seen.insert(seen.end(), more.begin(), more.end());
      }
      Batches expected;
      for (auto& ep : epochs) expected.insert(expected.end(), ep.begin(), ep.end());
      CHECK(seen == expected);
      CHECK(resumed.checkpoint().epoch == 3);
      CHECK(resumed.checkpoint().batches_yielded == 0);
    }
  }
}

TEST_CASE("is_data_loader_v", "[data]") {
  auto loader = make_data_loader(IndexDataset(3), LoaderOptions{});
  static_assert(accel::data::is_data_loader_v<decltype(loader)>);
  static_assert(accel::data::is_data_loader_v<const decltype(loader)&>);
  static_assert(!accel::data::is_data_loader_v<IndexDataset>);
  static_assert(!accel::data::is_data_loader_v<torch::Tensor>);
  static_assert(accel::data::MapStyleDataset<IndexDataset>);
  static_assert(!accel::data::MapStyleDataset<int>);
  SUCCEED();
}

TEST_CASE("TensorDataset reads whole batches, equal to per-sample stacking", "[data][collate]") {
  torch::manual_seed(0);
  const auto x = torch::randn({23, 3}), y = torch::randint(0, 10, {23});
  struct PerSample : torch::data::datasets::Dataset<PerSample> {
    torch::Tensor x, y;
    PerSample(torch::Tensor x, torch::Tensor y) : x(std::move(x)), y(std::move(y)) {}
    torch::data::Example<> get(size_t i) override { return {x[static_cast<int64_t>(i)], y[static_cast<int64_t>(i)]}; }
    torch::optional<size_t> size() const override { return static_cast<size_t>(x.size(0)); }
  };
  const LoaderOptions o{.batch_size = 4, .shuffle = true, .seed = 9};
  for (int workers : {0, 2}) {
    LoaderOptions ow = o;
    ow.num_workers = workers;
    auto fast = make_data_loader(accel::data::TensorDataset(x, y), ow).sharded(ShardSpec{1, 2, true, true});
    auto slow = make_data_loader(PerSample(x, y), o).sharded(ShardSpec{1, 2, true, true});
    static_assert(std::is_same_v<decltype(fast)::batch_type, torch::data::Example<>>);
    std::vector<torch::data::Example<>> a, b;
    for (auto& e : fast) a.push_back(e);
    for (auto& e : slow) b.push_back(e);
    REQUIRE(a.size() == b.size());
    REQUIRE(static_cast<int64_t>(a.size()) == fast.size());
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(torch::equal(a[i].data, b[i].data));
      CHECK(torch::equal(a[i].target, b[i].target));
    }
    a.front().data.zero_();  // a copy: the dataset is unchanged
    CHECK(torch::equal(fast.dataset().data(), x));
  }
  CHECK_THROWS_WITH(accel::data::TensorDataset(x, torch::zeros({5})),
                    Catch::Matchers::ContainsSubstring("accel: TensorDataset got 23 samples but 5 targets"));
}

TEST_CASE("set_epoch reaches a dataset that has one", "[data]") {
  struct EpochAware : accel_test::IndexDataset {
    using IndexDataset::IndexDataset;
    void set_epoch(int64_t e) { *seen = e; }
    std::shared_ptr<int64_t> seen = std::make_shared<int64_t>(-1);
  };
  EpochAware ds(4);
  auto loader = make_data_loader(ds, LoaderOptions{});
  loader.set_epoch(3);
  CHECK(*ds.seen == 3);
  CHECK(loader.epoch() == 3);
}

TEST_CASE("the API.md spelling compiles and the iterator is a C++20 input iterator", "[data]") {
  IndexDataset dataset(130);
  auto loader = accel::data::make_data_loader(dataset, accel::data::LoaderOptions{
      .batch_size = 64, .shuffle = true, .drop_last = false, .num_workers = 0, .seed = 42});
  static_assert(std::input_iterator<decltype(loader.begin())>);
  int64_t samples = 0;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    loader.set_epoch(epoch);
    for (auto& [data, target] : loader) {
      CHECK(torch::equal(target, data * 10));
      samples += data.size(0);
    }
  }
  CHECK(samples == 260);
}

TEST_CASE("plain copies share the position; detached, sharded and skipping copies do not",
          "[data][resume]") {
  auto loader = make_data_loader(IndexDataset(10), LoaderOptions{.batch_size = 3, .shuffle = true});
  auto copy = loader;  // what prepare() returns and save_state() keeps
  for (auto& b : copy) {
    (void)b;
    break;
  }
  CHECK(loader.batches_yielded() == 1);
  collect(copy);
  CHECK(loader.epoch() == 1);
  loader.restore(LoaderCheckpoint{4, 2});
  CHECK(copy.checkpoint().epoch == 4);
  CHECK(copy.checkpoint().batches_yielded == 2);

  auto own = loader.detached();
  auto shard = loader.sharded(ShardSpec{0, 2});
  auto skipping = loader.skip_first_batches(1);
  CHECK(own.checkpoint().epoch == 4);
  CHECK(shard.epoch() == 4);
  collect(own);
  collect(shard);
  collect(skipping);
  CHECK(own.epoch() == 5);
  CHECK(shard.epoch() == 5);
  CHECK(skipping.epoch() == 5);
  CHECK(loader.epoch() == 4);
  CHECK(loader.batches_yielded() == 2);
}

TEST_CASE("default collate of arithmetic targets, pairs and tuples", "[data][collate]") {
  struct Mixed {
    std::tuple<torch::Tensor, std::pair<int64_t, double>, torch::data::Example<torch::Tensor, int64_t>> get(size_t i) {
      const auto x = static_cast<int64_t>(i);
      return {torch::full({2}, x), {x, 0.5 * static_cast<double>(x)}, {torch::tensor(x), 7 * x}};
    }
    size_t size() const { return 3; }
  };
  auto loader = make_data_loader(Mixed{}, LoaderOptions{.batch_size = 3});
  using B = decltype(loader)::batch_type;
  static_assert(std::is_same_v<B, std::tuple<torch::Tensor, std::pair<torch::Tensor, torch::Tensor>,
                                             torch::data::Example<torch::Tensor, torch::Tensor>>>);
  int n = 0;
  for (auto& [t, p, e] : loader) {
    CHECK(t.sizes() == torch::IntArrayRef{3, 2});
    CHECK(p.first.scalar_type() == torch::kLong);
    CHECK(to_vec(p.first) == std::vector<int64_t>{0, 1, 2});
    CHECK(p.second.scalar_type() == torch::kDouble);
    CHECK(p.second[2].item<double>() == 1.0);
    CHECK(to_vec(e.target) == std::vector<int64_t>{0, 7, 14});
    ++n;
  }
  CHECK(n == 1);
  std::map<std::string, torch::Tensor> m{{"a", torch::ones({1})}};
  CHECK(accel::data::to_device(m, torch::Device(torch::kCPU)).at("a").device().is_cpu());
}

// Issue 13 B12: the active-loader stack was process-global, so a thread saw
// the loader another thread iterated. Two threads are inside their own loops
// at the same time; each must see its own.
TEST_CASE("active_loader_state is per thread", "[data][state]") {
  std::barrier both_inside(2);
  std::atomic<int> wrong{0};
  auto run = [&](size_t n) {
    auto loader = make_data_loader(IndexDataset(n), LoaderOptions{.batch_size = 1});
    bool first = true;
    for (auto& batch : loader) {
      (void)batch;
      if (first) both_inside.arrive_and_wait();  // the other thread has started its loop too
      const auto* s = accel::data::active_loader_state();
      if (s == nullptr || s->num_batches != static_cast<int64_t>(n)) wrong.fetch_add(1);
      if (first) both_inside.arrive_and_wait();  // and checked, before either loop ends
      first = false;
    }
    if (accel::data::active_loader_state() != nullptr) wrong.fetch_add(1);
  };
  std::thread a(run, 3), b(run, 5);
  a.join();
  b.join();
  CHECK(wrong.load() == 0);
}
