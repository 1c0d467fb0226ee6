// The CPU backend's operators (SYSTEM.md S3), all in namespace ml4::cpu, on f32
// activations, row-major. Each is tested against an f64 reference in tests/ops/.
#pragma once

#include "ops/cpu/attention.h"
#include "ops/cpu/basic.h"
#include "ops/cpu/linear.h"
#include "ops/cpu/moe.h"
#include "ops/cpu/norm.h"
#include "ops/cpu/quant.h"
#include "ops/cpu/rope.h"
