// Runs the CUDA kernels of codecs.cu on the host, so their parity with the CPU code can be
// checked on machines without a GPU (kernels/tests/cuda_host_emulation.rs builds and runs
// this with any C++20 compiler).
//
// Every CUDA thread is a host thread; the 32 threads of a warp meet at a barrier for each
// __shfl_xor_sync, as a warp does. The IEEE intrinsics map to plain float operations
// (volatile, compiled with -ffp-contract=off, so each is rounded once as on the GPU).
//
// Usage: host_emulation DIR. DIR/cases.txt lists "codec n nonfinite_index" lines (-1 when
// the CPU accepts the input with NaN/Inf); for each, DIR holds in_N.f32 and the CPU's
// cpu_CODEC_N.{data,scales,dec}. Prints one line per mismatch and "K ok, M mismatched";
// exits non-zero on any mismatch.

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

using std::max;
using std::min;

#define __device__
#define __forceinline__ inline
#define __global__
#define __restrict__

struct dim3 {
    unsigned x = 0, y = 0, z = 0;
};
thread_local dim3 blockIdx, threadIdx;
dim3 blockDim;
struct float4 {
    float x, y, z, w;
};
struct uint2 {
    unsigned x, y;
};
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float __fadd_rn(float a, float b) {
    volatile float r = a + b;
    return r;
}
static inline float __fmul_rn(float a, float b) {
    volatile float r = a * b;
    return r;
}
static inline float __fdiv_rn(float a, float b) {
    volatile float r = a / b;
    return r;
}
static inline float cospif(float x) { return cosf(3.14159265358979f * x); }

struct Warp {
    std::barrier<> bar{32};
    unsigned slot[32];
};
thread_local Warp* this_warp;
thread_local int this_lane;

static unsigned __shfl_xor_sync(unsigned, unsigned v, int offset) {
    this_warp->slot[this_lane] = v;
    this_warp->bar.arrive_and_wait();
    unsigned r = this_warp->slot[this_lane ^ offset];
    this_warp->bar.arrive_and_wait();
    return r;
}

static std::mutex atomic_mutex;
static unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    std::lock_guard<std::mutex> guard(atomic_mutex);
    unsigned long long old = *p;
    if (v < old) *p = v;
    return old;
}

#include "codecs.cu"

static void launch(unsigned grid, unsigned block, const std::function<void()>& body) {
    blockDim.x = block;
    for (unsigned b = 0; b < grid; b++) {
        for (unsigned w = 0; w < block / 32; w++) {
            Warp warp;
            std::vector<std::thread> lanes;
            for (int l = 0; l < 32; l++) {
                lanes.emplace_back([&, b, w, l] {
                    blockIdx.x = b;
                    threadIdx.x = w * 32 + l;
                    this_warp = &warp;
                    this_lane = l;
                    body();
                });
            }
            for (auto& t : lanes) t.join();
        }
    }
}

static std::vector<char> slurp(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

typedef void (*EncodeFn)(const float*, u8*, float*, u64, u64*);
typedef void (*DecodeFn)(const u8*, const float*, float*, u64, u64*);

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: host_emulation DIR\n");
        return 2;
    }
    std::string dir = argv[1];
    std::ifstream cases(dir + "/cases.txt");
    std::string name;
    size_t n;
    long long nonfinite_index;
    int ok = 0, bad = 0;
    while (cases >> name >> n >> nonfinite_index) {
        std::string suffix = name;
        std::replace(suffix.begin(), suffix.end(), '-', '_');
        EncodeFn enc = nullptr;
        DecodeFn dec = nullptr;
#define KERNELS(S)         \
    if (suffix == #S) {    \
        enc = enc_##S;     \
        dec = dec_##S;     \
    }
        KERNELS(bf16)
        KERNELS(fp8_e4m3_b32)
        KERNELS(fp8_e4m3_b128)
        KERNELS(int8_b32)
        KERNELS(int4_g32)
        KERNELS(int4_g64)
        KERNELS(int4_g128)
        if (!enc) {
            printf("unknown codec %s\n", name.c_str());
            bad++;
            continue;
        }
        size_t block = 0;
        int kind = -1;  // 0 fp8, 1 int8, 2 int4
        if (name != "bf16") {
            block = std::stoul(name.substr(name.find_last_of("bg") + 1));
            kind = name[0] == 'f' ? 0 : name[3] == '8' ? 1 : 2;
        }
        std::string stem = dir + "/cpu_" + name + "_" + std::to_string(n);
        std::vector<char> in = slurp(dir + "/in_" + std::to_string(n) + ".f32");
        std::vector<char> cpu_data = slurp(stem + ".data");
        std::vector<char> cpu_scales = slurp(stem + ".scales");
        std::vector<char> cpu_dec = slurp(stem + ".dec");
        if (in.size() != 4 * n || cpu_dec.size() != 4 * n) {
            printf("%s n=%zu: missing input files\n", name.c_str(), n);
            bad++;
            continue;
        }
        std::vector<float> x(n);
        memcpy(x.data(), in.data(), 4 * n);
        std::vector<u8> data(cpu_data.size(), 0xab);
        std::vector<float> scales(cpu_scales.size() / 4, -7.0f);
        std::vector<float> y(n, -9.0f);
        size_t threads = block ? (n + block - 1) / block * (block / 4) : (n + 3) / 4;
        unsigned grid = (unsigned)((threads + 255) / 256);
        std::vector<std::string> problems;

        u64 fault = ~0ull;
        launch(grid, 256, [&] { enc(x.data(), data.data(), scales.data(), n, &fault); });
        if (fault != ~0ull) problems.push_back("encode reported a fault");
        if (memcmp(data.data(), cpu_data.data(), cpu_data.size()) != 0) {
            size_t i = 0;
            while (data[i] == (u8)cpu_data[i]) i++;
            problems.push_back("data differs at byte " + std::to_string(i));
        }
        if (memcmp(scales.data(), cpu_scales.data(), cpu_scales.size()) != 0) problems.push_back("scales differ");

        launch(grid, 256, [&] {
            dec((const u8*)cpu_data.data(), (const float*)cpu_scales.data(), y.data(), n, &fault);
        });
        if (fault != ~0ull) problems.push_back("decode reported a fault");
        if (memcmp(y.data(), cpu_dec.data(), 4 * n) != 0) problems.push_back("decode differs");

        std::vector<float> xn = x;
        xn[n * 3 / 5] = NAN;
        if (n > 1) xn[n - 1] = INFINITY;
        u64 nf = ~0ull;
        launch(grid, 256, [&] { enc(xn.data(), data.data(), scales.data(), n, &nf); });
        long long got = nf == ~0ull ? -1 : (long long)nf;
        if (got != nonfinite_index) {
            problems.push_back("non-finite index " + std::to_string(got) + ", cpu " + std::to_string(nonfinite_index));
        }

        // Fault order as on the CPU: a bad scale reports 2 * (its block's first value), a bad
        // code 2 * index + 1, the int4 padding nibble 2 * n + 1; the smallest wins.
        if (block && n >= 2 * block + 1) {
            auto run = [&](std::vector<u8>& d, std::vector<float>& s) {
                u64 f = ~0ull;
                launch(grid, 256, [&] { dec(d.data(), s.data(), y.data(), n, &f); });
                return f;
            };
            auto bad_code = [&](std::vector<u8>& d, size_t i) {
                if (kind == 2)
                    d[i / 2] = (i % 2) ? ((d[i / 2] & 0x0f) | 0x80) : ((d[i / 2] & 0xf0) | 0x08);
                else if (kind == 1)
                    d[i] = 0x80;
                else
                    d[i] = 0x7f;
            };
            std::vector<u8> d(cpu_data.begin(), cpu_data.end());
            std::vector<float> s(cpu_scales.size() / 4);
            memcpy(s.data(), cpu_scales.data(), cpu_scales.size());
            s[1] = -1.0f;
            bad_code(d, 5);
            if (run(d, s) != 11) problems.push_back("bad code before bad scale");
            d.assign(cpu_data.begin(), cpu_data.end());
            bad_code(d, block + 3);
            if (run(d, s) != 2 * block) problems.push_back("bad scale before bad code of its block");
            memcpy(s.data(), cpu_scales.data(), cpu_scales.size());
            d.assign(cpu_data.begin(), cpu_data.end());
            s[0] = __uint_as_float(0x7f7fffffu);  // scale * Q overflows
            if (run(d, s) != 0) problems.push_back("overflowing scale accepted");
            memcpy(s.data(), cpu_scales.data(), cpu_scales.size());
            if (kind == 2 && (n & 1)) {
                d[n / 2] |= 0x30;
                if (run(d, s) != 2 * n + 1) problems.push_back("non-zero padding nibble accepted");
            }
        }

        if (problems.empty()) {
            ok++;
        } else {
            bad++;
            for (auto& p : problems) printf("%s n=%zu: %s\n", name.c_str(), n, p.c_str());
        }
    }
    printf("%d ok, %d mismatched\n", ok, bad);
    return bad == 0 && ok > 0 ? 0 : 1;
}
