// A stand-in for what a kernel MLX JIT-compiles for Metal sees in front of it (<metal_stdlib> and MLX's utils.h:
// `using namespace metal`, float16_t, bfloat16_t), so that clang in C++14 mode can check this project's rendered
// Metal sources without an Apple toolchain (tests/metal/test_metal_sources.py). It declares only names the Metal
// Shading Language defines, with MSL's signatures, and nothing permissive: a name it lacks is an error.
// Not modelled: MLX's other utilities (a body using them fails this check: a false alarm, never a miss), textures,
// atomics, simdgroup matrices.
#pragma once

// Address spaces. device, constant and threadgroup are real clang address spaces, so mixing them is an error.
// `thread` is the default address space of locals (C++'s own); here it is a type tag without meaning, so that the
// check can find a pointer or reference declared with no address space at all, which Metal rejects.
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread __attribute__((btf_type_tag("thread")))

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
typedef long ptrdiff_t;
typedef _Float16 half;
typedef __bf16 bfloat;

typedef float float2 __attribute__((ext_vector_type(2)));
typedef float float3 __attribute__((ext_vector_type(3)));
typedef float float4 __attribute__((ext_vector_type(4)));
typedef half half2 __attribute__((ext_vector_type(2)));
typedef half half3 __attribute__((ext_vector_type(3)));
typedef half half4 __attribute__((ext_vector_type(4)));
typedef bfloat bfloat2 __attribute__((ext_vector_type(2)));
typedef bfloat bfloat4 __attribute__((ext_vector_type(4)));
typedef int int2 __attribute__((ext_vector_type(2)));
typedef int int3 __attribute__((ext_vector_type(3)));
typedef int int4 __attribute__((ext_vector_type(4)));
typedef uint uint2 __attribute__((ext_vector_type(2)));
typedef uint uint3 __attribute__((ext_vector_type(3)));
typedef uint uint4 __attribute__((ext_vector_type(4)));
typedef short short2 __attribute__((ext_vector_type(2)));
typedef short short4 __attribute__((ext_vector_type(4)));
typedef ushort ushort2 __attribute__((ext_vector_type(2)));
typedef ushort ushort3 __attribute__((ext_vector_type(3)));
typedef ushort ushort4 __attribute__((ext_vector_type(4)));
typedef uchar uchar2 __attribute__((ext_vector_type(2)));
typedef uchar uchar4 __attribute__((ext_vector_type(4)));

namespace metal {

// The types MSL's functions take: math on half, float and MLX's bfloat (bf16_math.h), scalars and vectors;
// SIMD-group functions on those and on integer scalars and vectors.
template <typename T> struct lx_math_type {};
template <> struct lx_math_type<float> { typedef float type; };
template <> struct lx_math_type<float2> { typedef float2 type; };
template <> struct lx_math_type<float3> { typedef float3 type; };
template <> struct lx_math_type<float4> { typedef float4 type; };
template <> struct lx_math_type<half> { typedef half type; };
template <> struct lx_math_type<half2> { typedef half2 type; };
template <> struct lx_math_type<half3> { typedef half3 type; };
template <> struct lx_math_type<half4> { typedef half4 type; };
template <> struct lx_math_type<bfloat> { typedef bfloat type; };
template <> struct lx_math_type<bfloat2> { typedef bfloat2 type; };
template <> struct lx_math_type<bfloat4> { typedef bfloat4 type; };

template <typename T> struct lx_simd_type : lx_math_type<T> {};
template <> struct lx_simd_type<int> { typedef int type; };
template <> struct lx_simd_type<int2> { typedef int2 type; };
template <> struct lx_simd_type<int4> { typedef int4 type; };
template <> struct lx_simd_type<uint> { typedef uint type; };
template <> struct lx_simd_type<uint2> { typedef uint2 type; };
template <> struct lx_simd_type<uint4> { typedef uint4 type; };
template <> struct lx_simd_type<short> { typedef short type; };
template <> struct lx_simd_type<ushort> { typedef ushort type; };
template <> struct lx_simd_type<char> { typedef char type; };
template <> struct lx_simd_type<uchar> { typedef uchar type; };
template <> struct lx_simd_type<bool> { typedef bool type; };

template <typename T> typename lx_math_type<T>::type abs(T x);
template <typename T> typename lx_math_type<T>::type fabs(T x);
template <typename T> typename lx_math_type<T>::type ceil(T x);
template <typename T> typename lx_math_type<T>::type floor(T x);
template <typename T> typename lx_math_type<T>::type round(T x);
template <typename T> typename lx_math_type<T>::type trunc(T x);
template <typename T> typename lx_math_type<T>::type exp(T x);
template <typename T> typename lx_math_type<T>::type exp2(T x);
template <typename T> typename lx_math_type<T>::type log(T x);
template <typename T> typename lx_math_type<T>::type log2(T x);
template <typename T> typename lx_math_type<T>::type sqrt(T x);
template <typename T> typename lx_math_type<T>::type rsqrt(T x);
template <typename T> typename lx_math_type<T>::type sin(T x);
template <typename T> typename lx_math_type<T>::type cos(T x);
template <typename T> typename lx_math_type<T>::type tanh(T x);
template <typename T> typename lx_math_type<T>::type max(T x, T y);
template <typename T> typename lx_math_type<T>::type min(T x, T y);
template <typename T> typename lx_math_type<T>::type fmax(T x, T y);
template <typename T> typename lx_math_type<T>::type fmin(T x, T y);
template <typename T> typename lx_math_type<T>::type pow(T x, T y);
template <typename T> typename lx_math_type<T>::type fma(T a, T b, T c);
template <typename T> typename lx_math_type<T>::type clamp(T x, T lo, T hi);
template <typename T> bool isnan(T x);
template <typename T> bool isinf(T x);
// metal_integer: abs, max and min of integers
int abs(int x);
int max(int x, int y);
int min(int x, int y);
uint max(uint x, uint y);
uint min(uint x, uint y);

template <typename T, typename U> T as_type(U x);

// metal_compute: barriers and the SIMD-group functions (MSL 2.4 names and signatures)
enum class mem_flags {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 64,
  mem_object_data = 128,
};
mem_flags operator|(mem_flags a, mem_flags b);
void threadgroup_barrier(mem_flags flags);
void simdgroup_barrier(mem_flags flags);

template <typename T> typename lx_simd_type<T>::type simd_sum(T data);
template <typename T> typename lx_simd_type<T>::type simd_product(T data);
template <typename T> typename lx_simd_type<T>::type simd_max(T data);
template <typename T> typename lx_simd_type<T>::type simd_min(T data);
template <typename T> typename lx_simd_type<T>::type simd_prefix_inclusive_sum(T data);
template <typename T> typename lx_simd_type<T>::type simd_prefix_exclusive_sum(T data);
template <typename T> typename lx_simd_type<T>::type simd_broadcast(T data, ushort broadcast_lane_id);
template <typename T> typename lx_simd_type<T>::type simd_shuffle(T data, ushort simd_lane_id);
template <typename T> typename lx_simd_type<T>::type simd_shuffle_xor(T data, ushort mask);
template <typename T> typename lx_simd_type<T>::type simd_shuffle_up(T data, ushort delta);
template <typename T> typename lx_simd_type<T>::type simd_shuffle_down(T data, ushort delta);

}  // namespace metal

// MLX's utils.h (bf16.h): the whole metal namespace, and the two names MLX gives its half types.
using namespace metal;
typedef half float16_t;
typedef bfloat bfloat16_t;
