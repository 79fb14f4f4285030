// epmoe: an expert-parallel Mixture-of-Experts layer. Include this and link epmoe::epmoe.
#pragma once

#include "epmoe/comm.hpp"
#include "epmoe/config.hpp"
#include "epmoe/errors.hpp"
#include "epmoe/layer.hpp"
#include "epmoe/tensor.hpp"
#include "epmoe/timing.hpp"
