// Linux's permission for the AMX tile state (ARCH_REQ_XCOMP_PERM, XTILEDATA), asked once per
// process by every kernel that runs tiles: torch's oneDNN asks too, but not before its first AMX
// kernel.
#pragma once

#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

namespace pagedkv_cpu {

inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

}  // namespace pagedkv_cpu
#endif
