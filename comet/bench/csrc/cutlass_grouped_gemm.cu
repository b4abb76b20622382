// CUTLASS 3.x SM90 grouped GEMM for comet's benchmark: the "what a tuned library does on the
// same rows" compute reference. Built and loaded by comet/bench/cutlass_ref.py (nvcc, ctypes).
//
//   D[rows_g, N] = A[rows_g, K] @ B[g][K, N]   for every local expert g with rows_g > 0
//
// A: the expert-grouped rows, row-major [R, K]; B: all experts' weights, [El, K, N] with N
// contiguous (CUTLASS "row-major B", MN-major); D: row-major [R, N]. bf16 in/out, fp32
// accumulation, no C operand (D = acc).
//
// Kept free of torch's C++ headers on purpose: a plain C ABI loaded with ctypes builds with
// any nvcc against the CUTLASS headers alone, whatever ABI the installed torch was built with.
//
// The device-side argument arrays (problem shapes, per-group pointers and strides) live at the
// start of the caller's workspace; CUTLASS's own workspace (per-SM TMA descriptors) follows.
// They are staged in pinned host memory and copied in with cudaMemcpyAsync on the caller's
// stream, so a call never waits for the GPU unless it has run a whole staging ring ahead.

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "cutlass/util/packed_stride.hpp"

#if !defined(CUTLASS_ARCH_MMA_MODIFIABLE_TMA_SM90_SUPPORTED)
#error "CUTLASS's SM90 grouped GEMM needs nvcc 12.3 or newer"
#endif

// A named namespace, not an anonymous one: nvcc's generated kernel stubs name the kernel's
// template arguments, and an anonymous namespace here collides with CuTe's own.
namespace comet_cutlass {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K)
using Shape3 = ProblemShape::UnderlyingProblemShape;
using Element = cutlass::bfloat16_t;
using Accum = float;
using LayoutA = cutlass::layout::RowMajor;   // [rows, K], K contiguous
using LayoutB = cutlass::layout::RowMajor;   // [K, N], N contiguous (MN-major B)
using LayoutD = cutlass::layout::RowMajor;   // [rows, N]
constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA alignment

// Two schedules, as CUTLASS-based grouped GEMMs commonly pick: a wide cooperative tile when
// groups have many rows, a short pingpong tile when they have few (less padding waste in M).
struct Cooperative {
  using Tile = Shape<_128, _256, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

struct Pingpong {
  using Tile = Shape<_64, _128, _128>;
  using Cluster = Shape<_1, _2, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <class Config>
struct GroupedGemm {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Config::Tile,
      typename Config::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, Accum, Accum,
      void, LayoutD*, kAlign,        // no C operand: beta is 0
      Element, LayoutD*, kAlign, typename Config::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Element, Accum, void, Accum>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element,
      LayoutB*, kAlign, Accum, typename Config::Tile, typename Config::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::Kernel>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

using CoopGemm = GroupedGemm<Cooperative>;
using PingGemm = GroupedGemm<Pingpong>;

// The three stride types agree between the two configurations (they follow the layouts), so
// one metadata layout serves both.
static_assert(std::is_same_v<CoopGemm::StrideA, PingGemm::StrideA>);
static_assert(std::is_same_v<CoopGemm::StrideB, PingGemm::StrideB>);
static_assert(std::is_same_v<CoopGemm::StrideD, PingGemm::StrideD>);
using StrideA = CoopGemm::StrideA;
using StrideB = CoopGemm::StrideB;
using StrideD = CoopGemm::StrideD;

// Groups whose average rows are at most this run on the 64-row pingpong tile.
constexpr int64_t kPingpongMaxAvgRows = 128;
constexpr size_t kAlignBytes = 256;
constexpr int kMaxDevices = 64;
constexpr int kStagingSlots = 32;

thread_local std::string g_error;

int fail(const std::string& msg) {
  g_error = msg;
  return 1;
}

int fail_cuda(const char* what, cudaError_t err) {
  return fail(std::string(what) + ": " + cudaGetErrorString(err));
}

size_t round_up(size_t n) { return (n + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

// Byte offsets of the device argument arrays at the start of the workspace.
struct MetaLayout {
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, bytes;
  explicit MetaLayout(int groups) {
    size_t g = static_cast<size_t>(groups), at = 0;
    auto take = [&](size_t n) { size_t here = at; at = round_up(at + n); return here; };
    shapes = take(g * sizeof(Shape3));
    ptr_a = take(g * sizeof(void*));
    ptr_b = take(g * sizeof(void*));
    ptr_d = take(g * sizeof(void*));
    stride_a = take(g * sizeof(StrideA));
    stride_b = take(g * sizeof(StrideB));
    stride_d = take(g * sizeof(StrideD));
    bytes = at;
  }
};

struct DeviceInfo {
  bool ready = false;
  int sm_count = 0;
  int coop_clusters = 0;  // max active clusters of each kernel (cudaOccupancyMaxActiveClusters)
  int ping_clusters = 0;
  // Pinned staging ring: slot i is reused only once its previous copy has executed.
  uint8_t* host[kStagingSlots] = {};
  size_t cap[kStagingSlots] = {};
  cudaEvent_t copied[kStagingSlots] = {};
  int next = 0;
};

std::mutex g_mutex;
DeviceInfo g_devices[kMaxDevices];

int device_info(int device, DeviceInfo** out) {
  if (device < 0 || device >= kMaxDevices) return fail("device index out of range");
  DeviceInfo& info = g_devices[device];
  if (!info.ready) {
    cudaError_t err = cudaDeviceGetAttribute(&info.sm_count, cudaDevAttrMultiProcessorCount,
                                             device);
    if (err != cudaSuccess) return fail_cuda("cudaDeviceGetAttribute", err);
    info.coop_clusters =
        cutlass::KernelHardwareInfo::query_device_max_active_clusters<CoopGemm::Kernel>();
    info.ping_clusters =
        cutlass::KernelHardwareInfo::query_device_max_active_clusters<PingGemm::Kernel>();
    for (int i = 0; i < kStagingSlots; ++i) {
      err = cudaEventCreateWithFlags(&info.copied[i], cudaEventDisableTiming);
      if (err != cudaSuccess) return fail_cuda("cudaEventCreate", err);
    }
    info.ready = true;
  }
  *out = &info;
  return 0;
}

// A pinned buffer of at least `bytes` that no pending copy still reads.
int staging_slot(DeviceInfo& info, size_t bytes, int* slot) {
  int i = info.next;
  info.next = (i + 1) % kStagingSlots;
  cudaError_t err = cudaEventSynchronize(info.copied[i]);  // normally long done
  if (err != cudaSuccess) return fail_cuda("cudaEventSynchronize", err);
  if (info.cap[i] < bytes) {
    if (info.host[i] != nullptr) cudaFreeHost(info.host[i]);
    info.host[i] = nullptr;
    info.cap[i] = 0;
    err = cudaHostAlloc(reinterpret_cast<void**>(&info.host[i]), bytes, cudaHostAllocDefault);
    if (err != cudaSuccess) return fail_cuda("cudaHostAlloc", err);
    info.cap[i] = bytes;
  }
  *slot = i;
  return 0;
}

template <class G>
typename G::Gemm::Arguments make_args(int groups, uint8_t* meta, const MetaLayout& lay,
                                      const Shape3* host_shapes, int device, int sm_count,
                                      int clusters) {
  using Args = typename G::Gemm::Arguments;
  cutlass::KernelHardwareInfo hw{device, sm_count, clusters};
  Args args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = {groups, reinterpret_cast<Shape3*>(meta + lay.shapes), host_shapes};
  args.mainloop.ptr_A = reinterpret_cast<const Element**>(meta + lay.ptr_a);
  args.mainloop.dA = reinterpret_cast<StrideA*>(meta + lay.stride_a);
  args.mainloop.ptr_B = reinterpret_cast<const Element**>(meta + lay.ptr_b);
  args.mainloop.dB = reinterpret_cast<StrideB*>(meta + lay.stride_b);
  // Fusion defaults are alpha 1, beta 0 (and no per-group scalars): D = acc.
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = nullptr;
  args.epilogue.ptr_D = reinterpret_cast<Element**>(meta + lay.ptr_d);
  args.epilogue.dD = reinterpret_cast<StrideD*>(meta + lay.stride_d);
  args.hw_info = hw;
  return args;
}

template <class G>
size_t cutlass_workspace(int groups, int device, int sm_count) {
  MetaLayout lay(groups);
  auto args = make_args<G>(groups, nullptr, lay, nullptr, device, sm_count, 0);
  return G::Gemm::get_workspace_size(args);
}

template <class G>
int run_gemm(int groups, uint8_t* meta, const MetaLayout& lay, const Shape3* host_shapes,
             int device, int sm_count, int clusters, void* workspace, size_t workspace_bytes,
             cudaStream_t stream) {
  auto args = make_args<G>(groups, meta, lay, host_shapes, device, sm_count, clusters);
  typename G::Gemm gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess)
    return fail(std::string("can_implement: ") + cutlassGetStatusString(st) +
                " (N and K must be multiples of 8, pointers 16-byte aligned)");
  if (G::Gemm::get_workspace_size(args) > workspace_bytes)
    return fail("workspace too small for CUTLASS");
  st = gemm.initialize(args, workspace, stream);
  if (st != cutlass::Status::kSuccess)
    return fail(std::string("initialize: ") + cutlassGetStatusString(st));
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess)
    return fail(std::string("run: ") + cutlassGetStatusString(st) + " / " +
                cudaGetErrorString(cudaGetLastError()));
  return 0;
}

}  // namespace comet_cutlass

using namespace comet_cutlass;

// Built with -fvisibility=hidden: only these entry points are exported.
#define COMET_API __attribute__((visibility("default")))

extern "C" {

// The message of the last failed call on this thread.
COMET_API const char* comet_cutlass_gmm_last_error() { return g_error.c_str(); }

// Workspace bytes `comet_cutlass_gmm_run` needs for up to `groups` groups on `device`.
COMET_API int comet_cutlass_gmm_workspace_bytes(int device, int groups, size_t* bytes) {
  if (groups < 0) return fail("negative group count");
  std::lock_guard<std::mutex> lock(g_mutex);
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return fail_cuda("cudaSetDevice", err);
  DeviceInfo* info = nullptr;
  if (int rc = device_info(device, &info)) return rc;
  size_t coop = cutlass_workspace<CoopGemm>(groups, device, info->sm_count);
  size_t ping = cutlass_workspace<PingGemm>(groups, device, info->sm_count);
  *bytes = MetaLayout(groups).bytes + round_up(coop > ping ? coop : ping);
  return 0;
}

// D = A @ B[g] for each group g of `expert_rows[g]` consecutive rows of A (host array of
// `groups` counts). Asynchronous on `stream`; `workspace` (device) must hold at least
// comet_cutlass_gmm_workspace_bytes(device, groups) and must not be in use by another call
// still pending on a different stream. Returns 0, or nonzero with comet_cutlass_gmm_last_error.
COMET_API int comet_cutlass_gmm_run(int device, const void* a, const void* b, void* d, int groups, int n,
                          int k, const int64_t* expert_rows, void* workspace,
                          size_t workspace_bytes, void* stream_handle) {
  if (groups < 0 || n <= 0 || k <= 0) return fail("bad sizes");
  if (n % kAlign != 0 || k % kAlign != 0) return fail("N and K must be multiples of 8");
  auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (misaligned(a) || misaligned(b) || misaligned(d))
    return fail("A, B and D must be 16-byte aligned");
  // CUTLASS keeps TMA descriptors (64-byte aligned) after the argument arrays.
  if (reinterpret_cast<uintptr_t>(workspace) % kAlignBytes != 0)
    return fail("the workspace must be 256-byte aligned");
  std::lock_guard<std::mutex> lock(g_mutex);
  cudaError_t err = cudaSetDevice(device);  // this library has its own (static) CUDA runtime
  if (err != cudaSuccess) return fail_cuda("cudaSetDevice", err);
  DeviceInfo* info = nullptr;
  if (int rc = device_info(device, &info)) return rc;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);

  // Non-empty groups only: CUTLASS needs no entry for an expert that received no rows.
  std::vector<Shape3> shapes;
  std::vector<const Element*> pa, pb;
  std::vector<Element*> pd;
  const auto* a_el = static_cast<const Element*>(a);
  const auto* b_el = static_cast<const Element*>(b);
  auto* d_el = static_cast<Element*>(d);
  int64_t row = 0, live_rows = 0;
  for (int g = 0; g < groups; ++g) {
    int64_t m = expert_rows[g];
    if (m < 0 || m > INT32_MAX) return fail("bad row count");
    if (m > 0) {
      shapes.push_back(Shape3{static_cast<int>(m), n, k});
      pa.push_back(a_el + row * k);
      pb.push_back(b_el + static_cast<int64_t>(g) * k * n);
      pd.push_back(d_el + row * n);
      live_rows += m;
    }
    row += m;
  }
  int live = static_cast<int>(shapes.size());
  if (live == 0) return 0;

  MetaLayout lay(live);
  int slot = 0;
  if (int rc = staging_slot(*info, lay.bytes, &slot)) return rc;
  uint8_t* host = info->host[slot];
  std::memcpy(host + lay.shapes, shapes.data(), live * sizeof(Shape3));
  std::memcpy(host + lay.ptr_a, pa.data(), live * sizeof(void*));
  std::memcpy(host + lay.ptr_b, pb.data(), live * sizeof(void*));
  std::memcpy(host + lay.ptr_d, pd.data(), live * sizeof(void*));
  auto sa = cutlass::make_cute_packed_stride(StrideA{}, {1, k, 1});  // M stride K, K stride 1
  auto sb = cutlass::make_cute_packed_stride(StrideB{}, {n, k, 1});  // N stride 1, K stride N
  auto sd = cutlass::make_cute_packed_stride(StrideD{}, {1, n, 1});  // M stride N, N stride 1
  for (int g = 0; g < live; ++g) {
    std::memcpy(host + lay.stride_a + g * sizeof(StrideA), &sa, sizeof(StrideA));
    std::memcpy(host + lay.stride_b + g * sizeof(StrideB), &sb, sizeof(StrideB));
    std::memcpy(host + lay.stride_d + g * sizeof(StrideD), &sd, sizeof(StrideD));
  }
  if (workspace_bytes < lay.bytes) return fail("workspace too small for the group arrays");
  auto* meta = static_cast<uint8_t*>(workspace);
  err = cudaMemcpyAsync(meta, host, lay.bytes, cudaMemcpyHostToDevice, stream);
  if (err != cudaSuccess) return fail_cuda("cudaMemcpyAsync", err);
  err = cudaEventRecord(info->copied[slot], stream);
  if (err != cudaSuccess) return fail_cuda("cudaEventRecord", err);

  void* cutlass_ws = meta + lay.bytes;
  size_t cutlass_bytes = workspace_bytes - lay.bytes;
  if (live_rows <= kPingpongMaxAvgRows * live)
    return run_gemm<PingGemm>(live, meta, lay, shapes.data(), device, info->sm_count,
                              info->ping_clusters, cutlass_ws, cutlass_bytes, stream);
  return run_gemm<CoopGemm>(live, meta, lay, shapes.data(), device, info->sm_count,
                            info->coop_clusters, cutlass_ws, cutlass_bytes, stream);
}

}  // extern "C"
