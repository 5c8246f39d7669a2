// The CPU render's runtime: runs one kernel body as a GPU would, one threadgroup after another, each thread a fiber.
//
// A thread runs until it reaches a threadgroup barrier or a SIMD-group operation (sum, shuffle); a barrier releases
// once every live thread of the threadgroup waits at one, a SIMD operation once every live lane of its SIMD group
// (32 consecutive threads of the threadgroup) waits at one, and then all lanes get their results together. Anything
// a GPU leaves undefined is an error here: lanes of one SIMD group at different operations, a SIMD operation in a
// group with exited lanes, a thread at a barrier while its group's lanes wait at a SIMD operation, an access out of
// a buffer's bounds. Threadgroup memory is filled with NaN bytes before every threadgroup and outputs before the
// launch (by the caller), so a read of something never written shows.
#pragma once
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ucontext.h>
#include <sys/mman.h>

struct uint3 {
  uint32_t x, y, z;
};
struct uint4 {
  uint32_t x, y, z, w;
};

// bfloat16 and float16 storage types: conversions are explicit (as on CUDA, where float * __nv_bfloat16 does not
// compile), rounding to nearest even.
struct lx_bf16 {
  uint16_t bits;
  lx_bf16() = default;
  explicit lx_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40u);
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  explicit operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

struct lx_f16 {
  uint16_t bits;
  lx_f16() = default;
  explicit lx_f16(float f) : bits(encode(f)) {}
  explicit operator float() const {
    uint32_t s = uint32_t(bits & 0x8000u) << 16, e = (bits >> 10) & 0x1fu, m = bits & 0x3ffu, u;
    if (e == 0) {
      float f = std::ldexp(float(m), -24);
      return s ? -f : f;
    }
    u = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t encode(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
    const float a = std::fabs(f);
    if (std::isnan(a)) return uint16_t(sign | 0x7e00u);
    if (a >= 65520.0f) return uint16_t(sign | 0x7c00u);  // rounds to infinity
    if (a < 6.103515625e-05f) {  // subnormal: multiples of 2^-24, nearest even
      return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.0f)));
    }
    std::memcpy(&u, &a, 4);
    uint32_t e = (u >> 23) - 112, m = u & 0x7fffffu;
    uint32_t h = (e << 10) | (m >> 13), rest = m & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return uint16_t(sign | h);
  }
};

void lx_fail(const char* what, ...) __attribute__((format(printf, 1, 2)));

// A buffer argument: every index is checked against the buffer's size.
template <typename T>
struct lx_ptr {
  T* base;
  int64_t size, off;
  const char* name;
  T& operator[](int64_t i) const {
    const int64_t j = off + i;
    if (j < 0 || j >= size) lx_fail("%s[%lld] is out of bounds (size %lld)", name, (long long)j, (long long)size);
    return base[j];
  }
  T& operator*() const { return (*this)[0]; }
  lx_ptr operator+(int64_t d) const { return lx_ptr{base, size, off + d, name}; }
  lx_ptr operator-(int64_t d) const { return lx_ptr{base, size, off - d, name}; }
};

struct lx_thread {
  ucontext_t ctx;
  uint3 tid, gid, bid, nblk;
  int linear, state;  // state: LX_RUN, LX_BARRIER, LX_SIMD, LX_DONE
  int op, arg;        // a pending SIMD operation and its lane / mask
  float val, res;
};
enum { LX_RUN, LX_BARRIER, LX_SIMD, LX_DONE };
enum { LX_OP_SUM, LX_OP_SHFL, LX_OP_XOR };

static lx_thread* lx_threads;
static lx_thread* lx_cur;
static ucontext_t lx_sched;
static char lx_error[512];
static int lx_failed;

void lx_fail(const char* what, ...) {
  if (!lx_failed) {
    va_list ap;
    va_start(ap, what);
    std::vsnprintf(lx_error, sizeof lx_error, what, ap);
    va_end(ap);
    lx_failed = 1;
  }
  // an error ends the whole launch: back to the scheduler, never to run this thread again
  lx_cur->state = LX_DONE;
  swapcontext(&lx_cur->ctx, &lx_sched);
  std::abort();
}

static inline lx_thread& lx_thr() { return *lx_cur; }

static void lx_wait(int state) {
  lx_cur->state = state;
  swapcontext(&lx_cur->ctx, &lx_sched);
}

static inline void lx_barrier() { lx_wait(LX_BARRIER); }

static inline float lx_simd(int op, float v, int arg) {
  lx_cur->op = op;
  lx_cur->val = v;
  lx_cur->arg = arg;
  lx_wait(LX_SIMD);
  return lx_cur->res;
}
static inline float lx_simd_sum(float v) { return lx_simd(LX_OP_SUM, v, 0); }
static inline float lx_shfl(float v, int lane) { return lx_simd(LX_OP_SHFL, v, lane); }
static inline float lx_shfl_xor(float v, int mask) { return lx_simd(LX_OP_XOR, v, mask); }

static inline float lx_rsqrt(float x) { return 1.0f / std::sqrt(x); }
template <typename T>
static inline void lx_load8(lx_ptr<const T> p, float* o) {
  for (int i = 0; i < 8; ++i) o[i] = static_cast<float>(p[i]);
}
static inline uint4 lx_load_u4(lx_ptr<const uint32_t> p) { return uint4{p[0], p[1], p[2], p[3]}; }
static inline float lx_byte_f(uint32_t u, int i) { return static_cast<float>((u >> (8 * i)) & 0xFFu); }

// Resolves what waits: SIMD groups whose live lanes all wait at one operation, then a barrier every live thread
// waits at. Returns 0 when nothing could be released (a deadlock, unless every thread is done).
static int lx_release(int n) {
  int released = 0;
  for (int g = 0; g < n; g += 32) {
    const int e = g + 32 < n ? g + 32 : n;
    int waiting = 0, live = 0, op = -1, mixed = 0;
    for (int i = g; i < e; ++i) {
      if (lx_threads[i].state == LX_DONE) continue;
      ++live;
      if (lx_threads[i].state == LX_SIMD) {
        ++waiting;
        if (op >= 0 && lx_threads[i].op != op) mixed = 1;
        op = lx_threads[i].op;
      }
    }
    if (!waiting || waiting != live) continue;
    if (mixed) {
      std::snprintf(lx_error, sizeof lx_error, "lanes %d..%d of a SIMD group wait at different SIMD operations", g, e - 1);
      return -1;
    }
    if (live != e - g) {
      std::snprintf(lx_error, sizeof lx_error, "a SIMD operation in SIMD group %d..%d, some of whose lanes exited", g,
                    e - 1);
      return -1;
    }
    float v[32];
    for (int i = g; i < e; ++i) v[i - g] = lx_threads[i].val;
    for (int i = g; i < e; ++i) {
      lx_thread& t = lx_threads[i];
      const int lane = i - g, w = e - g;
      if (op == LX_OP_SUM) {  // the butterfly CUDA's warp sum runs (every lane gets the same value)
        float s[32];
        for (int j = 0; j < w; ++j) s[j] = v[j];
        for (int o = 16; o > 0; o >>= 1) {
          float nx[32];
          for (int j = 0; j < w; ++j) nx[j] = s[j] + s[(j ^ o) % w];
          for (int j = 0; j < w; ++j) s[j] = nx[j];
        }
        t.res = s[lane];
      } else {
        const int src = op == LX_OP_SHFL ? t.arg : (lane ^ t.arg);
        if (src < 0 || src >= w) {
          std::snprintf(lx_error, sizeof lx_error, "a shuffle reads lane %d of a %d-lane SIMD group", src, w);
          return -1;
        }
        t.res = v[src];
      }
      t.state = LX_RUN;
    }
    released = 1;
  }
  if (released) return 1;
  int live = 0, at_barrier = 0;
  for (int i = 0; i < n; ++i) {
    if (lx_threads[i].state != LX_DONE) ++live;
    if (lx_threads[i].state == LX_BARRIER) ++at_barrier;
  }
  if (live && at_barrier == live) {
    for (int i = 0; i < n; ++i)
      if (lx_threads[i].state == LX_BARRIER) lx_threads[i].state = LX_RUN;
    return 1;
  }
  if (live) {
    std::snprintf(lx_error, sizeof lx_error,
                  "deadlock: %d live threads, %d at a barrier, the rest at SIMD operations their groups' other lanes "
                  "never reach", live, at_barrier);
    return -1;
  }
  return 0;
}

extern "C" char __start_lxtg[] __attribute__((weak)), __stop_lxtg[] __attribute__((weak));

static void lx_entry();  // defined by the generated unit: runs the body for lx_cur, then marks it done

static const size_t LX_STACK = 128 * 1024;

// Runs grid / tg threadgroups of tg threads (grid a multiple of tg in every dimension). Returns 0, or 1 with the
// error in lx_error.
static int lx_run(const int grid[3], const int tg[3]) {
  const int n = tg[0] * tg[1] * tg[2];
  const int nb[3] = {grid[0] / tg[0], grid[1] / tg[1], grid[2] / tg[2]};
  char* stacks = (char*)mmap(nullptr, LX_STACK * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (stacks == MAP_FAILED) {
    std::snprintf(lx_error, sizeof lx_error, "no memory for %d thread stacks", n);
    return 1;
  }
  lx_thread* threads = new lx_thread[n];
  lx_threads = threads;
  lx_failed = 0;
  int rc = 0;
  for (int bz = 0; bz < nb[2] && !rc; ++bz)
    for (int by = 0; by < nb[1] && !rc; ++by)
      for (int bx = 0; bx < nb[0] && !rc; ++bx) {
        if (__start_lxtg != __stop_lxtg) std::memset(__start_lxtg, 0xFF, __stop_lxtg - __start_lxtg);
        for (int i = 0; i < n; ++i) {
          lx_thread& t = threads[i];
          t.linear = i;
          t.tid = uint3{uint32_t(i % tg[0]), uint32_t(i / tg[0] % tg[1]), uint32_t(i / (tg[0] * tg[1]))};
          t.bid = uint3{uint32_t(bx), uint32_t(by), uint32_t(bz)};
          t.nblk = uint3{uint32_t(nb[0]), uint32_t(nb[1]), uint32_t(nb[2])};
          t.gid = uint3{bx * tg[0] + t.tid.x, by * tg[1] + t.tid.y, bz * tg[2] + t.tid.z};
          t.state = LX_RUN;
          getcontext(&t.ctx);
          t.ctx.uc_stack.ss_sp = stacks + LX_STACK * i;
          t.ctx.uc_stack.ss_size = LX_STACK;
          t.ctx.uc_link = &lx_sched;
          makecontext(&t.ctx, lx_entry, 0);
        }
        for (;;) {
          for (int i = 0; i < n; ++i) {
            if (threads[i].state != LX_RUN) continue;
            lx_cur = &threads[i];
            swapcontext(&lx_sched, &threads[i].ctx);
            if (lx_failed) break;
          }
          if (lx_failed) {
            rc = 1;
            break;
          }
          const int r = lx_release(n);
          if (r < 0) rc = 1;
          if (r <= 0) break;
        }
      }
  delete[] threads;
  munmap(stacks, LX_STACK * n);
  return rc;
}
