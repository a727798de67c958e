// Which instruction set the kernels use: the highest this CPU (and its kernel, for AMX) offers,
// or a lower one when capped. The cap comes from JITNEY_KERNEL_ISA (avx2, avx2-int16, avx512,
// vnni, amx) when the library loads, or from jitney_set_isa() (engine/kernels/build.py calls it
// through ctypes, so the tests can run every path this machine has in one process).
// Also how many int8 digits the integer one passes give an activation (quant_vnni.cpp): 2, or 1
// from JITNEY_ACTIVATION_DIGITS=1 when the library loads, or from jitney_set_activation_digits()
// (the engine's --activation-digits).

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "blocks.h"

namespace jitney_kernels {
namespace {

// Linux keeps AMX's tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without that, the first tile instruction kills the process.
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

bool request_amx() {
#ifdef SYS_arch_prctl
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

int detect() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  if (!avx512) return kAvx2Int16;
  const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  if (!vnni) return kAvx512;
  const bool amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                   __builtin_cpu_supports("avx512bf16");
  return amx && request_amx() ? kAmx : kVnni;
}

int from_env(int best) {
  const char* cap = std::getenv("JITNEY_KERNEL_ISA");
  if (cap == nullptr || *cap == '\0') return best;
  if (std::strcmp(cap, "avx2") == 0) return kAvx2;
  if (std::strcmp(cap, "avx2-int16") == 0) return best < kAvx2Int16 ? best : kAvx2Int16;
  if (std::strcmp(cap, "avx512") == 0) return best < kAvx512 ? best : kAvx512;
  if (std::strcmp(cap, "vnni") == 0) return best < kVnni ? best : kVnni;
  return best;  // "amx" or anything else: no cap
}

int digits_from_env() {
  const char* digits = std::getenv("JITNEY_ACTIVATION_DIGITS");
  return digits != nullptr && std::strcmp(digits, "1") == 0 ? 1 : 2;
}

const int kBest = detect();
std::atomic<int> active{from_env(kBest)};
std::atomic<int> digits{digits_from_env()};

}  // namespace

int active_isa() { return active.load(std::memory_order_relaxed); }

int activation_digits() { return digits.load(std::memory_order_relaxed); }

bool amx_usable() { return kBest >= kAmx; }

}  // namespace jitney_kernels

extern "C" {
// The best instruction set of this machine (0 AVX2, 1 AVX2-int16, 2 AVX-512, 3 VNNI, 4 AMX) and
// the one in use.
int jitney_best_isa() { return jitney_kernels::kBest; }
int jitney_active_isa() { return jitney_kernels::active_isa(); }
// Use at most `cap` (but never more than the machine has); returns the one now in use.
int jitney_set_isa(int cap) {
  const int use = cap < jitney_kernels::kBest ? (cap < 0 ? 0 : cap) : jitney_kernels::kBest;
  jitney_kernels::active.store(use);
  return use;
}
int jitney_activation_digits() { return jitney_kernels::activation_digits(); }
// 1 or 2 (anything else: 2); returns the digits now in use.
int jitney_set_activation_digits(int n) {
  jitney_kernels::digits.store(n == 1 ? 1 : 2);
  return jitney_kernels::activation_digits();
}
}
