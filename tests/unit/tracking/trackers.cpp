// Trackers: JSONL, CSV and TensorBoard event files written by the main
// process; the event files checked byte-level (CRC32C, protobuf encoding) and
// read back by an independent stdlib-only Python reader.
#include <accel/accelerator.hpp>
#include <accel/backend.hpp>
#include <accel/launch/notebook_launcher.hpp>
#include <accel/tracking/trackers.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include "catch.hpp"
#include "paths.hpp"
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace tr = accel::tracking;
namespace td = accel::tracking::detail;

namespace {

fs::path scratch(const std::string& name) { return accel_test::fresh_dir("tracking", name); }

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream s(text);
  for (std::string l; std::getline(s, l);) out.push_back(l);
  return out;
}

fs::path event_file(const fs::path& dir) {
  for (auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) return e.path();
  return {};
}

// Runs the committed Python reader on an event file; returns its stdout lines.
std::vector<std::string> python_read(const fs::path& file, int* rc) {
  std::string cmd = "/usr/bin/python3 " ACCEL_TFEVENTS_READER " '" + file.string() + "' 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  while (auto n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  int status = ::pclose(p);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return lines(out);
}

}  // namespace

TEST_CASE("CRC32C and TFRecord framing match the published values", "[tracking][tfevents]") {
  CHECK(td::crc32c("123456789") == 0xE3069283U);  // RFC 3720 check value
  CHECK(td::crc32c("") == 0U);
  std::string zeros(32, '\0');
  CHECK(td::crc32c(zeros) == 0x8A9136AAU);  // RFC 3720 B.4: 32 bytes of zeros
  // A record: 8-byte length, masked CRC of it, data, masked CRC of data.
  auto rec = td::tfrecord("abc");
  REQUIRE(rec.size() == 8 + 4 + 3 + 4);
  CHECK(rec.substr(0, 8) == std::string("\x03\0\0\0\0\0\0\0", 8));
  CHECK(rec.substr(12, 3) == "abc");
  uint32_t c = td::crc32c("abc");
  uint32_t m = ((c >> 15) | (c << 17)) + 0xa282ead8U;
  CHECK(rec.substr(15, 4) == std::string{static_cast<char>(m & 0xFF), static_cast<char>((m >> 8) & 0xFF),
                                         static_cast<char>((m >> 16) & 0xFF),
                                         static_cast<char>(m >> 24)});
}

TEST_CASE("tf.Event protobuf bytes, field by field", "[tracking][tfevents]") {
  // wall_time 1.0 (field 1, fixed64), file_version (field 3, bytes).
  auto v = td::encode_file_version_event(1.0);
  CHECK(v == std::string("\x09\0\0\0\0\0\0\xf0\x3f\x1a\x0d" "brain.Event:2", 9 + 2 + 13));
  // step 300 (field 2, varint ac 02), summary (field 5) with one Value{tag "a", simple_value 0.5f}.
  auto e = td::encode_scalars_event(0.0, 300, {{"a", 0.5f}});
  const std::string expect("\x09\0\0\0\0\0\0\0\0"       // wall_time 0.0
                           "\x10\xac\x02"               // step 300
                           "\x2a\x0a"                   // summary, 10 bytes
                           "\x0a\x08"                   //   value, 8 bytes
                           "\x0a\x01" "a"               //     tag "a"
                           "\x15\0\0\0\x3f",            //     simple_value 0.5f
                           9 + 3 + 2 + 2 + 3 + 5);
  CHECK(e == expect);
}

TEST_CASE("JSONL, CSV, config and TensorBoard files from init_trackers/log/end_training",
          "[tracking][trackers]") {
  auto dir = scratch("single");
  accel::AcceleratorOptions opts;
  opts.project_dir = dir.string();
  accel::Accelerator<> acc(opts);
  acc.init_trackers("run1", {{"lr", 0.01}, {"batch_size", 64}, {"optimizer", "adam"}, {"amp", false}});
  acc.log({{"loss", 0.5}, {"acc", 0.25}}, 1);
  acc.log({{"loss", 0.25}, {"acc", 0.5}, {"note", "a,b"}}, 2);
  acc.log({{"loss", 0.125}});  // no step: the count of earlier calls (2)
  acc.end_training();

  auto run = dir / "run1";
  auto config = nlohmann::json::parse(slurp(run / "config.json"));
  CHECK(config["lr"] == 0.01);
  CHECK(config["batch_size"] == 64);
  CHECK(config["optimizer"] == "adam");
  CHECK(config["amp"] == false);

  auto jl = lines(slurp(run / "metrics.jsonl"));
  REQUIRE(jl.size() == 3);
  CHECK(jl[0] == R"({"step":1,"acc":0.25,"loss":0.5})");
  CHECK(jl[1] == R"({"step":2,"acc":0.5,"loss":0.25,"note":"a,b"})");
  CHECK(jl[2] == R"({"step":2,"loss":0.125})");

  // The third key appeared late: the header was widened and the file rewritten.
  auto csv = lines(slurp(run / "metrics.csv"));
  REQUIRE(csv.size() == 4);
  CHECK(csv[0] == "step,acc,loss,note");
  CHECK(csv[1] == "1,0.25,0.5,");
  CHECK(csv[2] == "2,0.5,0.25,\"a,b\"");
  CHECK(csv[3] == "2,,0.125,");

  auto ev = event_file(run);
  REQUIRE(!ev.empty());
  int rc = -1;
  auto events = python_read(ev, &rc);
  REQUIRE(rc == 0);
  REQUIRE(events.size() == 4);  // file_version + one per log() call
  auto first = nlohmann::json::parse(events[0]);
  CHECK(first["file_version"] == "brain.Event:2");
  CHECK(first["wall_time"].get<double>() > 1.7e9);
  auto e1 = nlohmann::json::parse(events[1]);
  CHECK(e1["step"] == 1);
  CHECK(e1["values"]["loss"] == 0.5);
  CHECK(e1["values"]["acc"] == 0.25);
  auto e2 = nlohmann::json::parse(events[2]);
  CHECK(e2["step"] == 2);
  CHECK_FALSE(e2["values"].contains("note"));  // strings are not TensorBoard scalars
  auto e3 = nlohmann::json::parse(events[3]);
  CHECK(e3["step"] == 2);
  CHECK(e3["values"]["loss"] == 0.125);
  CHECK(e3["values"].size() == 1);

  // After end_training, log() needs a new init.
  CHECK_THROWS_WITH(acc.log({{"loss", 1.0}}, 3),
                    Catch::Matchers::ContainsSubstring("accel: log() was called before init_trackers()"));
}

TEST_CASE("the Python reader rejects a corrupted event file", "[tracking][tfevents]") {
  auto dir = scratch("corrupt");
  tr::Trackers t;
  t.init(dir.string(), "r", {}, {.jsonl = false, .csv = false, .tensorboard = true}, true);
  t.log({{"x", 1.0}}, 0);
  t.finish();
  auto ev = event_file(dir / "r");
  auto bytes = slurp(ev);
  bytes[bytes.size() - 6] ^= 0x01;  // flip a bit inside the last record's data
  { std::ofstream(ev, std::ios::binary | std::ios::trunc) << bytes; }
  int rc = 0;
  auto out = python_read(ev, &rc);
  CHECK(rc == 1);
  REQUIRE(!out.empty());
  CHECK(out.back().find("bad data CRC") != std::string::npos);
}

TEST_CASE("tracker errors say what to do", "[tracking][trackers]") {
  accel::Accelerator<> acc;  // no project_dir
  CHECK_THROWS_WITH(acc.init_trackers("run"),
                    Catch::Matchers::ContainsSubstring("accel: init_trackers() needs a directory to write to") &&
                        Catch::Matchers::ContainsSubstring(".project_dir = \"runs\""));
  CHECK_THROWS_WITH(acc.log({{"loss", 1.0}}),
                    Catch::Matchers::ContainsSubstring("accel: log() was called before init_trackers()"));
  tr::Trackers t;
  CHECK_THROWS_WITH(t.init(std::string("/tmp"), "a/b", {}, {}, true),
                    Catch::Matchers::ContainsSubstring("one directory name"));
  // A project_dir that is a file: a clear error, not a crash.
  auto dir = scratch("notadir");
  { std::ofstream(dir / "file") << "x"; }
  CHECK_THROWS_WITH(t.init((dir / "file").string(), "run", {}, {}, true),
                    Catch::Matchers::ContainsSubstring("accel: cannot create the tracking directory"));
}

namespace {
void two_process_body(std::string project_dir) {
  accel::AcceleratorOptions opts;
  opts.project_dir = project_dir;
  accel::Accelerator<accel::backend::Gloo> acc(opts);
  acc.init_trackers("dp", {{"world", acc.num_processes()}});
  for (int step = 0; step < 3; ++step) acc.log({{"rank", acc.process_index()}}, step);
  acc.end_training();
}
}  // namespace

TEST_CASE("only the main process writes, on 2 processes", "[tracking][trackers][multiprocess]") {
  auto dir = scratch("dp");
  accel::LaunchOptions lo;
  lo.num_processes = 2;
  lo.master_port = 0;
  lo.timeout = std::chrono::seconds(120);
  accel::notebook_launcher(two_process_body, std::make_tuple(dir.string()), lo);
  auto run = dir / "dp";
  CHECK(nlohmann::json::parse(slurp(run / "config.json"))["world"] == 2);
  auto jl = lines(slurp(run / "metrics.jsonl"));
  REQUIRE(jl.size() == 3);  // rank 1 wrote nothing
  for (int s = 0; s < 3; ++s)
    CHECK(jl[static_cast<size_t>(s)] == R"({"step":)" + std::to_string(s) + R"(,"rank":0})");
  int files = 0;
  for (auto& e : fs::directory_iterator(run))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) ++files;
  CHECK(files == 1);
}

TEST_CASE("Google's protobuf parser reads every event record (when protoc is installed)",
          "[tracking][tfevents]") {
  if (!fs::exists("/usr/bin/protoc")) {
    ACCEL_TEST_SKIP("protoc is not installed (Debian: protobuf-compiler)");
  }
  auto dir = scratch("protoc");
  tr::Trackers t;
  t.init(dir.string(), "r", {}, {.jsonl = false, .csv = false, .tensorboard = true}, true);
  t.log({{"loss", 0.5}, {"acc", 0.25}}, 7);
  t.finish();
  auto bytes = slurp(event_file(dir / "r"));
  std::vector<std::string> decoded;
  size_t pos = 0;
  while (pos + 12 <= bytes.size()) {
    uint64_t n = 0;
    std::memcpy(&n, bytes.data() + pos, 8);
    auto record = dir / ("record" + std::to_string(decoded.size()));
    { std::ofstream(record, std::ios::binary) << bytes.substr(pos + 12, n); }
    pos += 16 + n;
    std::string cmd = "/usr/bin/protoc --decode_raw < '" + record.string() + "' 2>&1";
    std::string out;
    FILE* p = ::popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    char buf[4096];
    while (auto k = std::fread(buf, 1, sizeof buf, p)) out.append(buf, k);
    REQUIRE(::pclose(p) == 0);
    decoded.push_back(out);
  }
  REQUIRE(decoded.size() == 2);
  // Field numbers of tf.Event: 1 wall_time (fixed64), 2 step, 3 file_version, 5 summary.
  CHECK(decoded[0].find("3: \"brain.Event:2\"") != std::string::npos);
  CHECK(decoded[1].find("2: 7\n") != std::string::npos);
  // Summary.value (1) { tag (1), simple_value (2, fixed32 float bits) }: 0.25f, 0.5f.
  CHECK(decoded[1].find("1: \"acc\"\n    2: 0x3e800000") != std::string::npos);
  CHECK(decoded[1].find("1: \"loss\"\n    2: 0x3f000000") != std::string::npos);
}
