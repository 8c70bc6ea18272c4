// SPDX-License-Identifier: Apache-2.0
/// @file Umbrella header of accel::data: make_data_loader, DataLoader,
/// sharding, collate, to_device and the active-loader state.
#ifndef ACCEL_DATA_HPP
#define ACCEL_DATA_HPP

#include <accel/data/batch_sampler_shard.hpp>
#include <accel/data/collate.hpp>
#include <accel/data/data_loader.hpp>
#include <accel/data/loader_options.hpp>
#include <accel/data/loader_state.hpp>
#include <accel/data/make_data_loader.hpp>
#include <accel/data/tensor_dataset.hpp>
#include <accel/data/to_device.hpp>

#endif  // ACCEL_DATA_HPP
