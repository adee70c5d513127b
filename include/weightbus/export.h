// SPDX-License-Identifier: Apache-2.0
// Symbol visibility for libweightbus. The library is built with hidden visibility by default;
// only declarations marked WB_EXPORT are part of the shared object's interface.
#pragma once

#if defined(WEIGHTBUS_STATIC_DEFINE)
#define WB_EXPORT
#elif defined(__GNUC__)
#define WB_EXPORT __attribute__((visibility("default")))
#else
#define WB_EXPORT
#endif
