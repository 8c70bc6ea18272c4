// Precompiled for every test target (and the examples built with them): the
// heavy, stable headers. accel.hpp is here too: parsing it (c10d, Gloo,
// Boost.Hana, nlohmann-json, yaml-cpp) was about 15 s of every test file.
#include <torch/torch.h>
#include "catch.hpp"
#include <accel/accel.hpp>
