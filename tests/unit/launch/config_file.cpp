// Tests accel's config file: reading Accelerate's own files (the JSON that
// write_basic_config writes and a YAML file from `accelerate config`), warnings
// for unknown keys, errors naming key and line, write_basic_config's content
// and refusal to overwrite, and default_config_path()'s precedence.
#include <accel/launch/config_file.hpp>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "catch.hpp"
#include "paths.hpp"

namespace fs = std::filesystem;

namespace {

fs::path scratch(const std::string& name) { return accel_test::fresh_dir("config_file", name); }

fs::path write(const fs::path& path, const std::string& text) {
  std::ofstream(path) << text;
  return path;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Sets (or, with nullopt, unsets) one variable for a scope.
class EnvVar {
 public:
  EnvVar(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) ::setenv(name, value->c_str(), 1);
    else ::unsetenv(name);
  }
  ~EnvVar() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    else ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// accelerate's write_basic_config output on a 2-GPU machine (inventory 7.2).
const char* kAccelerateJson = R"({
  "compute_environment": "LOCAL_MACHINE",
  "debug": false,
  "distributed_type": "MULTI_GPU",
  "downcast_bf16": false,
  "enable_cpu_affinity": false,
  "machine_rank": 0,
  "main_training_function": "main",
  "mixed_precision": "no",
  "num_machines": 1,
  "num_processes": 2,
  "rdzv_backend": "static",
  "same_network": false,
  "tpu_use_cluster": false,
  "tpu_use_sudo": false,
  "use_cpu": false
}
)";

// What `accelerate config` writes for two machines (YAML, quoted 'no').
const char* kAccelerateYaml = R"(compute_environment: LOCAL_MACHINE
debug: true
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 1
main_process_ip: 192.168.1.10
main_process_port: 29501
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
)";

}  // namespace

TEST_CASE("config_file: Accelerate's JSON basic config is read as it is", "[launch][config]") {
  const auto dir = scratch("json");
  std::ostringstream warn;
  const auto c = accel::read_config_file(write(dir / "default_config.yaml", kAccelerateJson), &warn);
  CHECK(c.compute_environment == "LOCAL_MACHINE");
  CHECK(c.distributed_type == accel::DistributedType::MultiGpu);
  CHECK(c.num_processes == 2);
  CHECK(c.num_machines == 1);
  CHECK(c.machine_rank == 0);
  CHECK(c.mixed_precision == "no");
  CHECK_FALSE(c.use_cpu);
  CHECK_FALSE(c.debug);
  CHECK_FALSE(c.main_process_port);
  CHECK_FALSE(c.backend);
  CHECK(c.source == dir / "default_config.yaml");
  CHECK(c.warnings.empty());
  CHECK(warn.str().empty());
}

TEST_CASE("config_file: Accelerate's YAML config is read as it is", "[launch][config]") {
  const auto dir = scratch("yaml");
  std::ostringstream warn;
  const auto c = accel::read_config_file(write(dir / "c.yaml", kAccelerateYaml), &warn);
  CHECK(c.distributed_type == accel::DistributedType::MultiCpu);
  CHECK(c.debug);
  CHECK_FALSE(c.downcast_bf16);
  CHECK(c.gpu_ids == "all");
  CHECK(c.machine_rank == 1);
  CHECK(c.main_process_ip == "192.168.1.10");
  CHECK(c.main_process_port == 29501);
  CHECK(c.mixed_precision == "bf16");
  CHECK(c.num_machines == 2);
  CHECK(c.num_processes == 8);
  CHECK(c.same_network);
  CHECK(c.use_cpu);
  CHECK(warn.str().empty());  // empty tpu_env and false tpu_* ask for nothing

  SECTION("accel's own backend key and -1 for 'unset'") {
    const auto d = accel::read_config_file(
        write(dir / "b.yaml", "backend: mpi\nnum_processes: -1\nmain_process_ip: null\n"), &warn);
    CHECK(d.backend == "mpi");
    CHECK_FALSE(d.num_processes);
    CHECK_FALSE(d.main_process_ip);
  }
  SECTION("an empty file is all defaults") {
    const auto d = accel::read_config_file(write(dir / "empty.yaml", ""), &warn);
    CHECK(d.num_machines == 1);
    CHECK(d.mixed_precision == "no");
  }
}

TEST_CASE("config_file: unknown keys and unsupported features warn with key and line",
          "[launch][config]") {
  const auto dir = scratch("warn");
  std::ostringstream warn;
  const auto path = write(dir / "c.yaml",
                          "mixed_precision: fp16\n"
                          "num_proceses: 4\n"
                          "deepspeed_config:\n"
                          "  zero_stage: 2\n"
                          "distributed_type: FSDP\n");
  const auto c = accel::read_config_file(path, &warn);
  REQUIRE(c.warnings.size() == 3);
  CHECK(c.warnings[0] == "accel: warning: " + path.string() +
                             ":2: key 'num_proceses': unknown key, ignored. Check its spelling "
                             "(keys are Accelerate's).");
  CHECK_THAT(c.warnings[1], Catch::Matchers::ContainsSubstring(":3: key 'deepspeed_config'") &&
                                Catch::Matchers::ContainsSubstring("does not support"));
  CHECK_THAT(c.warnings[2], Catch::Matchers::ContainsSubstring(":5: key 'distributed_type'") &&
                                Catch::Matchers::ContainsSubstring("read as MULTI_GPU"));
  CHECK(c.distributed_type == accel::DistributedType::MultiGpu);
  CHECK_FALSE(c.num_processes);
  CHECK(warn.str() == c.warnings[0] + "\n" + c.warnings[1] + "\n" + c.warnings[2] + "\n");
}

TEST_CASE("config_file: wrong types and values are ConfigErrors naming key, line and choices",
          "[launch][config]") {
  const auto dir = scratch("errors");
  auto error_of = [&](const std::string& text) {
    const auto path = write(dir / "c.yaml", text);
    try {
      accel::read_config_file(path, nullptr);
    } catch (const accel::ConfigError& e) {
      return std::string(e.what());
    }
    FAIL("no ConfigError for: " << text);
    return std::string();
  };
  const std::string file = (dir / "c.yaml").string();
  CHECK(error_of("use_cpu: false\nnum_processes: two\n") ==
        "accel: " + file + ":2: key 'num_processes' is 'two', not a whole number. Use a whole "
        "number in [-1, 1048576].");
  CHECK(error_of("debug: false\n\nmixed_precision: fp8\n") ==
        "accel: " + file + ":3: key 'mixed_precision' has the value 'fp8', which is not allowed. "
        "Use one of: no, fp16, bf16.");
  CHECK(error_of("use_cpu: maybe\n") ==
        "accel: " + file + ":1: key 'use_cpu' is 'maybe', not a boolean. Use true or false "
        "(yes/no also accepted).");
  CHECK(error_of("main_process_port: 70000\n") ==
        "accel: " + file + ":1: key 'main_process_port' is 70000, out of range. Use a whole "
        "number in [0, 65535].");
  CHECK_THAT(error_of("distributed_type: [MULTI_GPU]\n"),
             Catch::Matchers::ContainsSubstring(":1: key 'distributed_type' is a list") &&
                 Catch::Matchers::ContainsSubstring("MULTI_CPU"));
  CHECK_THAT(error_of("num_processes: 0\n"), Catch::Matchers::ContainsSubstring("key 'num_processes' is 0"));
  CHECK_THAT(error_of("num_machines: 2\nmachine_rank: 2\n"),
             Catch::Matchers::ContainsSubstring("machine_rank 2 is not below num_machines 2"));
  CHECK_THAT(error_of("a: 1\nb: [1, 2\n"), Catch::Matchers::ContainsSubstring(file + ":") &&
                                               Catch::Matchers::ContainsSubstring("not valid YAML or JSON"));
  CHECK_THAT(error_of("- 1\n- 2\n"), Catch::Matchers::ContainsSubstring("top level must be a mapping"));
  CHECK_THROWS_WITH(accel::read_config_file(dir / "missing.yaml"),
                    Catch::Matchers::ContainsSubstring("missing.yaml does not exist") &&
                        Catch::Matchers::ContainsSubstring("accel config"));
  // Duplicates: yaml-cpp keeps both, other readers the first or the last one.
  CHECK(error_of("num_processes: 2\nuse_cpu: true\nnum_processes: 4\n") ==
        "accel: " + file + ":3: key 'num_processes' appears twice (lines 1 and 3). Keep one of them.");
  CHECK_THROWS_WITH(accel::read_config_file(dir, nullptr),
                    Catch::Matchers::ContainsSubstring(dir.string() + " is a directory"));
  // A huge value is quoted in part, not echoed whole.
  const std::string huge(1 << 20, 'x');
  const std::string msg = error_of("mixed_precision: " + huge + "\n");
  CHECK(msg.size() < 400);
  CHECK_THAT(msg, Catch::Matchers::ContainsSubstring("xxx... (1048576 characters)"));
}

TEST_CASE("config_file: an empty file means all defaults, with a warning", "[launch][config]") {
  const auto path = write(scratch("empty") / "c.yaml", "");
  std::ostringstream warn;
  const auto c = accel::read_config_file(path, &warn);
  CHECK(c.num_processes == std::nullopt);
  CHECK(warn.str() == "accel: warning: " + path.string() + " is empty; every setting takes its default.\n");
}

TEST_CASE("config_file: write_basic_config writes Accelerate's file and never overwrites",
          "[launch][config]") {
  const auto dir = scratch("basic");
  const auto path = dir / "nested" / "dir" / "default_config.yaml";
  accel::write_basic_config("BF16", path);  // Accelerate lower-cases the mode
  REQUIRE(fs::exists(path));
#if !ACCEL_WITH_CUDA
  // Byte for byte what accelerate writes on a machine without GPU.
  CHECK(slurp(path) == R"({
  "compute_environment": "LOCAL_MACHINE",
  "debug": false,
  "distributed_type": "NO",
  "downcast_bf16": false,
  "enable_cpu_affinity": false,
  "machine_rank": 0,
  "main_training_function": "main",
  "mixed_precision": "bf16",
  "num_machines": 1,
  "num_processes": 1,
  "rdzv_backend": "static",
  "same_network": false,
  "tpu_use_cluster": false,
  "tpu_use_sudo": false,
  "use_cpu": true
}
)");
#endif
  std::ostringstream warn;
  const auto c = accel::read_config_file(path, &warn);
  CHECK(c.mixed_precision == "bf16");
  CHECK(warn.str().empty());

  // An existing file is left alone, with a note on stderr.
  write(path, "mixed_precision: fp16\n");
  std::ostringstream err;
  auto* old = std::cerr.rdbuf(err.rdbuf());
  accel::write_basic_config("no", path);
  std::cerr.rdbuf(old);
  CHECK(slurp(path) == "mixed_precision: fp16\n");
  CHECK_THAT(err.str(), Catch::Matchers::ContainsSubstring("already exists at " + path.string()) &&
                            Catch::Matchers::ContainsSubstring("will not override"));

  CHECK_THROWS_AS(accel::write_basic_config("fp8", dir / "other.yaml"), accel::ConfigError);
  CHECK_THROWS_WITH(accel::write_basic_config("fp8", dir / "other.yaml"),
                    "accel: mixed_precision 'fp8' is not supported. Use one of: no, fp16, bf16.");
  CHECK_FALSE(fs::exists(dir / "other.yaml"));
}

TEST_CASE("config_file: write_config_file round-trips through read_config_file",
          "[launch][config]") {
  const auto dir = scratch("roundtrip");
  accel::LaunchConfig c;
  c.distributed_type = accel::DistributedType::MultiCpu;
  c.backend = "gloo";
  c.num_processes = 4;
  c.num_machines = 2;
  c.machine_rank = 1;
  c.main_process_ip = "10.0.0.1";
  c.main_process_port = 1234;
  c.mixed_precision = "bf16";
  c.debug = true;
  c.use_cpu = true;
  accel::write_config_file(c, dir / "sub" / "c.yaml");
  const std::string text = slurp(dir / "sub" / "c.yaml");
  CHECK_THAT(text, Catch::Matchers::StartsWith("backend: gloo\ncompute_environment: LOCAL_MACHINE\n"));
  std::ostringstream warn;
  const auto d = accel::read_config_file(dir / "sub" / "c.yaml", &warn);
  CHECK(warn.str().empty());
  CHECK(d.distributed_type == c.distributed_type);
  CHECK(d.backend == c.backend);
  CHECK(d.num_processes == c.num_processes);
  CHECK(d.num_machines == c.num_machines);
  CHECK(d.machine_rank == c.machine_rank);
  CHECK(d.main_process_ip == c.main_process_ip);
  CHECK(d.main_process_port == c.main_process_port);
  CHECK(d.mixed_precision == c.mixed_precision);
  CHECK(d.debug);
  CHECK(d.use_cpu);
}

TEST_CASE("config_file: default_config_path precedence", "[launch][config]") {
  EnvVar file("ACCEL_CONFIG_FILE", "/explicit/accel.yaml");
  EnvVar xdg("XDG_CONFIG_HOME", "/xdg");
  EnvVar home("HOME", "/home/someone");
  CHECK(accel::default_config_path() == fs::path("/explicit/accel.yaml"));
  {
    EnvVar unset_file("ACCEL_CONFIG_FILE", std::nullopt);
    CHECK(accel::default_config_path() == fs::path("/xdg/accel/default_config.yaml"));
    {
      EnvVar unset_xdg("XDG_CONFIG_HOME", std::nullopt);
      CHECK(accel::default_config_path() ==
            fs::path("/home/someone/.config/accel/default_config.yaml"));
      EnvVar empty_xdg("XDG_CONFIG_HOME", "");  // empty counts as unset
      CHECK(accel::default_config_path() ==
            fs::path("/home/someone/.config/accel/default_config.yaml"));
      EnvVar unset_home("HOME", std::nullopt);
      CHECK_THROWS_AS(accel::default_config_path(), accel::ConfigError);
    }
  }
}

TEST_CASE("config_file: Accelerate's own file is used when accel has none", "[launch][config]") {
  const auto dir = scratch("in_effect");
  EnvVar file("ACCEL_CONFIG_FILE", (dir / "accel" / "default_config.yaml").string());
  EnvVar hf("HF_HOME", (dir / "hf").string());
  CHECK(accel::accelerate_config_path() == dir / "hf" / "accelerate" / "default_config.yaml");
  CHECK_FALSE(accel::config_file_in_effect());
  fs::create_directories(dir / "hf" / "accelerate");
  write(dir / "hf" / "accelerate" / "default_config.yaml", kAccelerateJson);
  CHECK(accel::config_file_in_effect() == dir / "hf" / "accelerate" / "default_config.yaml");
  accel::write_basic_config("no");
  CHECK(accel::config_file_in_effect() == dir / "accel" / "default_config.yaml");
  {
    EnvVar unset_hf("HF_HOME", std::nullopt);
    EnvVar cache("XDG_CACHE_HOME", "/cache");
    CHECK(accel::accelerate_config_path() ==
          fs::path("/cache/huggingface/accelerate/default_config.yaml"));
  }
}
