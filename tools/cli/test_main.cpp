// SPDX-License-Identifier: Apache-2.0
// accel-test: what `accel test` runs (the accel command hands its arguments
// over with exec). A program of its own because its workers train with
// LibTorch, which the accel command does not load at start-up.
#include <iostream>

#include <CLI/CLI.hpp>

#include "test_command.hpp"
#include "test_options.hpp"

int main(int argc, char** argv) {
  CLI::App app{"accel test: check this machine's setup (run it as `accel test`)"};
  accel::cli::TestOptions options(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    return accel::cli::run_test(options.flags(), std::cout, std::cerr);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
}
