// Which sanitizer this translation unit is compiled with, named the same way under GCC (which
// defines __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__) and Clang (which, before version 16, only
// answers __has_feature). A header of macros: no state, nothing to link.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define DT_ADDRESS_SANITIZER 1
#endif
#if defined(__SANITIZE_THREAD__)
#define DT_THREAD_SANITIZER 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(DT_ADDRESS_SANITIZER)
#define DT_ADDRESS_SANITIZER 1
#endif
#if __has_feature(thread_sanitizer) && !defined(DT_THREAD_SANITIZER)
#define DT_THREAD_SANITIZER 1
#endif
#endif
