// HiLoRe codec kernels, compiled at run time by NVRTC (no headers needed).
//
// Every step mirrors the CPU code in kernels/src/{bf16,fp8,int8,int4,scaled}.rs and the
// format specs in their module docs. Only correctly rounded IEEE operations are used
// (__fmul_rn, __fadd_rn, __fdiv_rn are never contracted into FMAs; the program is also
// compiled with --fmad=false --ftz=false --prec-div=true), so the bytes equal the CPU's.
//
// Thread layout of the scaled formats: each thread handles 4 consecutive values; the B/4
// threads of one block of B values sit in one aligned group of lanes of a warp and reduce
// the block's absmax with warp shuffles.
//
// Faults are reported through one u64 with atomicMin, ordered as the CPU orders them:
//   encode: the index of the first non-finite value;
//   decode: 2 * (first value of the block) for an invalid scale, 2 * index + 1 for an
//           invalid code (index n for a non-zero int4 padding nibble).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define MIN_NORMAL_F32 __uint_as_float(0x00800000u)

__device__ __forceinline__ bool is_inf_or_nan(float x) {
    return (__float_as_uint(x) & 0x7fffffffu) >= 0x7f800000u;
}

// ---------------------------------------------------------------- element conversions

// f32 -> E4M3FN: round to nearest even, saturate to +-448 (+-Inf too), NaN -> 0x7f|sign.
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
    u32 bits = __float_as_uint(x);
    u32 sign = (bits >> 24) & 0x80u;
    u32 abs = bits & 0x7fffffffu;
    // Below 2^-6: adding 2^14 (ulp 2^-9) rounds to a count of 2^-9 steps (0..8).
    u32 sub = __float_as_uint(__fadd_rn(__uint_as_float(abs), 16384.0f)) - 0x46800000u;
    // Normal: round 23 mantissa bits to 3, ties to even, rebias 127 -> 7, saturate.
    u32 rounded = abs + 0x7ffffu + ((abs >> 20) & 1u);
    u32 norm = min((rounded >> 20) - (120u << 3), 0x7eu);
    u32 mag = abs < 0x3c800000u ? sub : norm;
    mag = abs > 0x7f800000u ? 0x7fu : mag;
    return sign | mag;
}

// E4M3FN -> f32, exact (0x7f/0xff give NaN).
__device__ __forceinline__ float e4m3_to_f32(u32 code) {
    u32 sign = (code & 0x80u) << 24;
    u32 mag = code & 0x7fu;
    float normal = __uint_as_float((mag << 20) + (120u << 23));
    float sub = __fmul_rn((float)mag, 0.001953125f);  // mag * 2^-9, exact
    float v = mag < 8u ? sub : normal;
    v = mag == 0x7fu ? __uint_as_float(0x7fc00000u) : v;
    return __uint_as_float(__float_as_uint(v) | sign);
}

// Round to nearest integer, ties to even (|t| <= 2^22), then clamp to [-q, q].
__device__ __forceinline__ int round_clamp(float t, int q) {
    int r = (int)__float_as_uint(__fadd_rn(t, 12582912.0f)) - 0x4B400000;
    return max(-q, min(q, r));
}

__device__ __forceinline__ u32 f32_to_bf16(float x) {
    u32 b = __float_as_uint(x);
    u32 nan = (b | 0x00400000u) >> 16;
    u32 rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    return (b & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
}

__device__ __forceinline__ float bf16_to_f32(u32 h) {
    return __uint_as_float(h << 16);
}

// ---------------------------------------------------------------- block scale

// scale = absmax / q, inv = q / absmax; zero/subnormal scale -> (0, 0); scale lowered by
// ulps while scale * q overflows.
__device__ __forceinline__ void block_scale(float absmax, float q, float* scale, float* inv) {
    float s = __fdiv_rn(absmax, q);
    if (!(s >= MIN_NORMAL_F32)) {
        *scale = 0.0f;
        *inv = 0.0f;
        return;
    }
    while (is_inf_or_nan(__fmul_rn(s, q))) {
        s = __uint_as_float(__float_as_uint(s) - 1u);
    }
    *scale = s;
    *inv = __fdiv_rn(q, absmax);
}

__device__ __forceinline__ bool scale_is_valid(float s, float q) {
    if (__float_as_uint(s) == 0u) return true;
    return s >= MIN_NORMAL_F32 && !is_inf_or_nan(__fmul_rn(s, q));
}

// ---------------------------------------------------------------- scaled formats

enum { FP8 = 0, INT8 = 1, INT4 = 2 };

template <int KIND> struct Q;
template <> struct Q<FP8> { static constexpr float v = 448.0f; };
template <> struct Q<INT8> { static constexpr float v = 127.0f; };
template <> struct Q<INT4> { static constexpr float v = 7.0f; };

template <int KIND>
__device__ __forceinline__ u32 quantize(float x, float inv) {
    float t = __fmul_rn(x, inv);
    if (KIND == FP8) return f32_to_e4m3(t);
    if (KIND == INT8) return (u32)(u8)(signed char)round_clamp(t, 127);
    return (u32)round_clamp(t, 7) & 0xfu;
}

template <int B, int KIND>
__device__ __forceinline__ void encode_scaled(const float* __restrict__ x, u8* __restrict__ data,
                                              float* __restrict__ scales, u64 n, u64* err) {
    const int L = B / 4;
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 blk = t / L;
    u32 lane = (u32)(t % L);
    u64 nblocks = (n + B - 1) / B;
    u64 base = blk * B + (u64)lane * 4;

    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (blk < nblocks) {
        if (base + 4 <= n) {
            float4 f = *reinterpret_cast<const float4*>(x + base);
            v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
        } else {
            for (int k = 0; k < 4; k++)
                if (base + k < n) v[k] = x[base + k];
        }
    }
    u32 m = 0;
    for (int k = 0; k < 4; k++) m = max(m, __float_as_uint(v[k]) & 0x7fffffffu);
    // Every lane of the warp takes part in the shuffles, also those past the end.
    for (int off = L / 2; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (blk >= nblocks) return;
    if (m >= 0x7f800000u) {
        for (int k = 0; k < 4; k++) {
            if (base + k < n && is_inf_or_nan(v[k])) {
                atomicMin(err, base + k);
                break;
            }
        }
        return;
    }
    float s, inv;
    block_scale(__uint_as_float(m), Q<KIND>::v, &s, &inv);
    if (lane == 0) scales[blk] = s;

    u32 c[4];
    for (int k = 0; k < 4; k++) c[k] = quantize<KIND>(v[k], inv);  // padding values are 0
    if (KIND == INT4) {
        u32 b0 = c[0] | (c[1] << 4), b1 = c[2] | (c[3] << 4);
        u64 at = base / 2, data_len = (n + 1) / 2;
        if (base + 4 <= n) {
            *reinterpret_cast<u16*>(data + at) = (u16)(b0 | (b1 << 8));
        } else {
            if (at < data_len) data[at] = (u8)b0;
            if (at + 1 < data_len) data[at + 1] = (u8)b1;
        }
    } else {
        if (base + 4 <= n) {
            *reinterpret_cast<u32*>(data + base) = c[0] | (c[1] << 8) | (c[2] << 16) | (c[3] << 24);
        } else {
            for (int k = 0; k < 4; k++)
                if (base + k < n) data[base + k] = (u8)c[k];
        }
    }
}

template <int B, int KIND>
__device__ __forceinline__ void decode_scaled(const u8* __restrict__ data, const float* __restrict__ scales,
                                              float* __restrict__ y, u64 n, u64* err) {
    const int L = B / 4;
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    u64 blk = t / L;
    u32 lane = (u32)(t % L);
    u64 base = blk * B + (u64)lane * 4;
    if (base >= n) return;
    float s = scales[blk];
    if (!scale_is_valid(s, Q<KIND>::v)) {
        atomicMin(err, 2 * blk * B);
        return;
    }

    // codes of values base..base+3; values past n read as 0 (int4: the real padding nibble)
    int q[4];
    bool bad[4];
    float out[4];
    if (KIND == INT4) {
        u64 at = base / 2, data_len = (n + 1) / 2;
        u32 w;
        if (base + 4 <= n) {
            w = *reinterpret_cast<const u16*>(data + at);
        } else {
            w = (at < data_len ? data[at] : 0u) | ((at + 1 < data_len ? (u32)data[at + 1] : 0u) << 8);
        }
        for (int k = 0; k < 4; k++) {
            u32 nib = (w >> (4 * k)) & 0xfu;
            bad[k] = nib == 0x8u;
            q[k] = (int)(nib ^ 0x8u) - 8;  // sign-extend 4 bits
        }
    } else {
        u32 w;
        if (base + 4 <= n) {
            w = *reinterpret_cast<const u32*>(data + base);
        } else {
            w = 0;
            for (int k = 0; k < 4; k++)
                if (base + k < n) w |= (u32)data[base + k] << (8 * k);
        }
        for (int k = 0; k < 4; k++) {
            u32 code = (w >> (8 * k)) & 0xffu;
            if (KIND == FP8) {
                bad[k] = (code & 0x7fu) == 0x7fu;
                out[k] = __fmul_rn(e4m3_to_f32(code), s);
            } else {
                bad[k] = code == 0x80u;
                q[k] = (int)(signed char)(u8)code;
            }
        }
    }
    if (KIND != FP8) {
        for (int k = 0; k < 4; k++) out[k] = __fmul_rn((float)q[k], s);
    }
    for (int k = 0; k < 4; k++) {
        if (base + k < n && bad[k]) {
            atomicMin(err, 2 * (base + k) + 1);
            return;
        }
    }
    if (KIND == INT4 && (n & 1) && base + 4 > n && base <= n - 1) {
        // This thread holds value n - 1; the high nibble of its byte is padding.
        u32 pad = (data[(n - 1) / 2] >> 4) & 0xfu;
        if (pad != 0) atomicMin(err, 2 * n + 1);
    }
    if (base + 4 <= n) {
        *reinterpret_cast<float4*>(y + base) = make_float4(out[0], out[1], out[2], out[3]);
    } else {
        for (int k = 0; k < 4; k++)
            if (base + k < n) y[base + k] = out[k];
    }
}

#define SCALED_CODEC(NAME, B, KIND)                                                              \
    extern "C" __global__ void enc_##NAME(const float* x, u8* data, float* scales, u64 n,       \
                                          u64* err) {                                           \
        encode_scaled<B, KIND>(x, data, scales, n, err);                                        \
    }                                                                                           \
    extern "C" __global__ void dec_##NAME(const u8* data, const float* scales, float* y, u64 n, \
                                          u64* err) {                                           \
        decode_scaled<B, KIND>(data, scales, y, n, err);                                        \
    }

SCALED_CODEC(fp8_e4m3_b32, 32, FP8)
SCALED_CODEC(fp8_e4m3_b128, 128, FP8)
SCALED_CODEC(int8_b32, 32, INT8)
SCALED_CODEC(int4_g32, 32, INT4)
SCALED_CODEC(int4_g64, 64, INT4)
SCALED_CODEC(int4_g128, 128, INT4)

// ---------------------------------------------------------------- bf16 (4 values per thread)

extern "C" __global__ void enc_bf16(const float* __restrict__ x, u8* __restrict__ data,
                                    float* scales, u64 n, u64* err) {
    u64 base = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (base >= n) return;
    if (base + 4 <= n) {
        float4 f = *reinterpret_cast<const float4*>(x + base);
        uint2 w;
        w.x = f32_to_bf16(f.x) | (f32_to_bf16(f.y) << 16);
        w.y = f32_to_bf16(f.z) | (f32_to_bf16(f.w) << 16);
        *reinterpret_cast<uint2*>(data + 2 * base) = w;
    } else {
        for (u64 i = base; i < n; i++)
            *reinterpret_cast<u16*>(data + 2 * i) = (u16)f32_to_bf16(x[i]);
    }
}

extern "C" __global__ void dec_bf16(const u8* __restrict__ data, const float* scales,
                                    float* __restrict__ y, u64 n, u64* err) {
    u64 base = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (base >= n) return;
    if (base + 4 <= n) {
        uint2 w = *reinterpret_cast<const uint2*>(data + 2 * base);
        *reinterpret_cast<float4*>(y + base) =
            make_float4(bf16_to_f32(w.x & 0xffffu), bf16_to_f32(w.x >> 16),
                        bf16_to_f32(w.y & 0xffffu), bf16_to_f32(w.y >> 16));
    } else {
        for (u64 i = base; i < n; i++)
            y[i] = bf16_to_f32(*reinterpret_cast<const u16*>(data + 2 * i));
    }
}

// ---------------------------------------------------------------- benchmark input

__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Activation-like values: standard Gaussian (Box-Muller), about 1% of them times 100.
extern "C" __global__ void fill_heavy_tailed(float* x, u64 n, u64 seed) {
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 h1 = splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull));
    u64 h2 = splitmix64(h1 ^ 0x6a09e667f3bcc909ull);
    float u1 = (float)((h1 >> 40) + 1) * (1.0f / 16777216.0f);
    float u2 = (float)(h2 >> 40) * (1.0f / 16777216.0f);
    float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if (splitmix64(h2) % 100 == 0) z *= 100.0f;
    x[i] = z;
}
