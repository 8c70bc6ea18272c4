// Precompiled for every test target: the heavy, stable headers.
#include <torch/torch.h>
#include "catch.hpp"
