// Umbrella header: the whole public API.
#pragma once

#include "moekit/error.h"
#include "moekit/formats.h"
#include "moekit/gemm.h"
#include "moekit/runtime.h"
#include "moekit/tensor.h"
