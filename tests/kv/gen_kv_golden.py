#!/usr/bin/env python3
"""Golden bytes for tests/kv/kv_golden_test.cpp, written independently of ml4's C++.

Rules followed (vLLM csrc/cache_kernels.cu):
  fp8_ds_mla row (concat_and_cache_ds_mla_kernel): per 128-value tile
    scale = max(amax / 448, FLT_MIN) (f32, not rounded), byte = e4m3(x / scale);
    then the r/128 f32 scales, then dr bf16 rope values.
  indexer page (indexer_k_quant_and_cache): 64 x dI e4m3 values, then 64 x f32 scales,
    scale = max(amax, 1e-4) / 448.
e4m3 and bf16 rounding come from ml_dtypes (RNE), not from ml4.

Inputs are bit patterns from a 64-bit LCG that the C++ test regenerates exactly.
Command: python3 -m venv /tmp/v && /tmp/v/bin/pip install numpy ml_dtypes &&
         /tmp/v/bin/python tests/kv/gen_kv_golden.py   (writes tests/kv/golden/*.bin)
"""
import os
import struct

import ml_dtypes
import numpy as np

MASK = (1 << 64) - 1


class Lcg:
    def __init__(self, seed):
        self.s = seed & MASK

    def next32(self):
        self.s = (self.s * 6364136223846793005 + 1442695040888963407) & MASK
        return self.s >> 32

    def value(self, emin, emax):
        """sign * 1.m * 2^e with e uniform-ish in [emin, emax], as exact f32 bits."""
        a, b = self.next32(), self.next32()
        e = emin + a % (emax - emin + 1)
        bits = ((a >> 31) << 31) | ((127 + e) << 23) | (b & 0x7FFFFF)
        return struct.unpack("<f", struct.pack("<I", bits))[0]


def values(lcg, n, emin, emax):
    return np.array([lcg.value(emin, emax) for _ in range(n)], dtype=np.float32)


def e4m3(x):
    return x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def ds_mla_row(c, kr):
    tiles = c.reshape(-1, 128)
    amax = np.abs(tiles).max(axis=1).astype(np.float32)
    scale = np.maximum(amax / np.float32(448.0), np.finfo(np.float32).tiny).astype(np.float32)
    q = e4m3((tiles / scale[:, None]).astype(np.float32)).reshape(-1)
    rope = kr.astype(ml_dtypes.bfloat16).view(np.uint16)
    return q.tobytes() + scale.astype("<f4").tobytes() + rope.astype("<u2").tobytes()


def indexer_page(keys):
    t, d = keys.shape
    groups = keys.reshape(t, d // 128, 128)
    amax = np.abs(groups).max(axis=2).astype(np.float32)
    scale = (np.maximum(amax, np.float32(1e-4)) / np.float32(448.0)).astype(np.float32)
    q = e4m3((groups / scale[:, :, None]).astype(np.float32)).reshape(-1)
    return q.tobytes() + scale.astype("<f4").tobytes()


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
    os.makedirs(out, exist_ok=True)
    lcg = Lcg(20261202)
    rows = b""
    for _ in range(8):  # 8 tokens, r=512, dr=64
        c = values(lcg, 512, -12, 3)
        kr = values(lcg, 64, -8, 4)
        rows += ds_mla_row(c, kr)
    with open(os.path.join(out, "ds_mla_rows.bin"), "wb") as f:
        f.write(rows)
    lcg = Lcg(132)
    keys = values(lcg, 64 * 128, -14, 2).reshape(64, 128)  # one page, dI=128
    with open(os.path.join(out, "indexer_page.bin"), "wb") as f:
        f.write(indexer_page(keys))


if __name__ == "__main__":
    main()
