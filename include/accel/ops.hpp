// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella of the ops area: the collectives behind the Accelerator's
/// gather/reduce/broadcast, object collectives, work splitting, triggers,
/// uneven inputs and the batch-size search (docs/collectives.md).
#ifndef ACCEL_OPS_HPP
#define ACCEL_OPS_HPP

#include <accel/ops/batch_size.hpp>
#include <accel/ops/collectives.hpp>
#include <accel/ops/join.hpp>
#include <accel/ops/objects.hpp>
#include <accel/ops/split.hpp>
#include <accel/ops/trigger.hpp>

#endif  // ACCEL_OPS_HPP
