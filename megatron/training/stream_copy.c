/* A copy whose stores bypass the cache, for the memory tier's refills (memory_slots.py).
 *
 * A refill hashes each chunk of a tensor, then copies it into the slot's mapping. glibc's
 * memmove stores through the cache below its non-temporal threshold (3/4 of the shared
 * cache: 190 MB on this machine's VM, so every chunk), and each cache line it stores is
 * first read from memory. Streaming stores skip that read: a third less memory traffic for
 * a copy whose target nobody reads soon. The chunk's source is in the cache already, since
 * it was just hashed.
 *
 * Built by setup.py as an optional extension and loaded with ctypes (no Python API here);
 * without it, or off x86-64, the refill copies with memmove. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <emmintrin.h> /* SSE2: part of every x86-64 CPU */
#endif

void ftmaster_stream_copy(void *target, const void *source, size_t length)
{
#if defined(__x86_64__)
    char *to = (char *)target;
    const char *from = (const char *)source;
    size_t head = (16 - ((uintptr_t)to & 15)) & 15; /* streaming stores need 16-byte alignment */
    if (head > length)
        head = length;
    memcpy(to, from, head);
    to += head;
    from += head;
    length -= head;
    for (; length >= 64; length -= 64, to += 64, from += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)from);
        __m128i b = _mm_loadu_si128((const __m128i *)(from + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(from + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(from + 48));
        _mm_stream_si128((__m128i *)to, a);
        _mm_stream_si128((__m128i *)(to + 16), b);
        _mm_stream_si128((__m128i *)(to + 32), c);
        _mm_stream_si128((__m128i *)(to + 48), d);
    }
    memcpy(to, from, length);
    /* Streaming stores are weakly ordered: fenced before another process reads the slot. */
    _mm_sfence();
#else
    memcpy(target, source, length);
#endif
}
