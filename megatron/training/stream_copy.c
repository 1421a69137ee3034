/* A copy whose stores bypass the cache, and the refill loop around it, for the memory
 * tier's refills (memory_slots.py).
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
#include <time.h>

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

/* xxHash's XXH3 64-bit streaming calls, as python-xxhash's extension exports them: the
 * digests are the very ones the manifest's readers compute through that package. */
typedef int (*xxh3_reset_fn)(void *state);
typedef int (*xxh3_update_fn)(void *state, const void *input, size_t length);
typedef uint64_t (*xxh3_digest_fn)(const void *state);

/* One tensor's record in a slot's file (offsets from the file's start): the zip's header
 * from offset, the tensor's nbytes from data_offset, its trailer up to end; source is the
 * address of the tensor's bytes. */
typedef struct {
    uint64_t offset, data_offset, nbytes, end, source;
} ftmaster_record;

static uint64_t now_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

static void hash_into_both(xxh3_update_fn update, void *file_state, void *item_state,
                           const char *bytes, size_t length, uint64_t *hash_ns)
{
    uint64_t start = now_ns();
    update(file_state, bytes, length);
    update(item_state, bytes, length);
    *hash_ns += now_ns() - start;
}

/* memory_slots.py's refill of count records in file order, in one call: per record, the
 * header hashed from the mapping, each chunk of the tensor hashed into the file's and the
 * item's digest and then copied while still in the cache, the trailer hashed; the item's
 * digest goes to item_digests[i]. The file's state runs on from call to call. Adds the
 * nanoseconds spent copying and hashing to elapsed_ns[0] and [1]. Per tensor this does in
 * C what took tens of microseconds of Python (a 77 MB checkpoint has some 300 tensors). */
void ftmaster_refill(char *target, const ftmaster_record *records, size_t count, size_t chunk,
                     xxh3_reset_fn reset, xxh3_update_fn update, xxh3_digest_fn digest,
                     void *file_state, void *item_state, uint64_t *item_digests,
                     uint64_t *elapsed_ns)
{
    for (size_t i = 0; i < count; i++) {
        const ftmaster_record *record = &records[i];
        const char *source = (const char *)(uintptr_t)record->source;
        char *data = target + record->data_offset;
        reset(item_state);
        hash_into_both(update, file_state, item_state, target + record->offset,
                       record->data_offset - record->offset, &elapsed_ns[1]);
        for (uint64_t start = 0; start < record->nbytes; start += chunk) {
            size_t length = record->nbytes - start < chunk ? record->nbytes - start : chunk;
            hash_into_both(update, file_state, item_state, source + start, length, &elapsed_ns[1]);
            uint64_t copy_start = now_ns();
            ftmaster_stream_copy(data + start, source + start, length);
            elapsed_ns[0] += now_ns() - copy_start;
        }
        hash_into_both(update, file_state, item_state, data + record->nbytes,
                       record->end - record->data_offset - record->nbytes, &elapsed_ns[1]);
        item_digests[i] = digest(item_state);
    }
}
