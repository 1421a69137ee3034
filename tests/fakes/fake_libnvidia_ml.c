/* A fake libnvidia-ml.so.1 for driving the real pynvml bindings on a machine without a GPU.
 *
 * It exports the NVML entry points the monitor calls, with the real ABI, over N simulated
 * GPUs, and a few fake_* controls the tests call through ctypes: wedge a GPU (every call on
 * it blocks until released, as in a wedged driver), make its calls fail with an NVML error,
 * slow down set-up calls, queue XID events, set remapped-row flags, MIG mode and the field
 * value type, make a GPU's XID registration fail or its newer calls unsupported, and count the
 * calls each GPU received and the event sets made and freed. An XID is queued only for a GPU
 * registered on the live event set, as the driver records only registered devices' events.
 *
 * Build with -DOLD_DRIVER to leave out nvmlDeviceGetTemperatureV and
 * nvmlDeviceGetCurrentClocksEventReasons, as a driver older than the binding would.
 */
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define MAX_GPUS 128
#define MAX_EVENTS 256

enum { SUCCESS = 0, INVALID_ARGUMENT = 2, NOT_SUPPORTED = 3, INSUFFICIENT_SIZE = 7, TIMEOUT = 10 };

typedef struct { int index; } device_t;
typedef struct { unsigned gpu, memory; } utilization_t;
typedef struct { unsigned long long total, free, used; } memory_t;
typedef struct { unsigned version; unsigned sensor; int temperature; } temperature_v1_t;
typedef struct {
    unsigned field_id, scope_id;
    long long timestamp, latency_usec;
    unsigned value_type, nvml_return;
    union { double d; unsigned ui; unsigned long ul; unsigned long long ull;
            long long sll; int si; unsigned short us; } value;
} field_value_t;
typedef struct {
    device_t *device;
    unsigned long long event_type, event_data;
    unsigned gpu_instance, compute_instance;
} event_data_t;

static device_t devices[MAX_GPUS];
static int gpu_count = 2, configured;
static atomic_int wedged[MAX_GPUS];
static atomic_int error_of[MAX_GPUS];
static atomic_long calls[MAX_GPUS];
static int remap_pending[MAX_GPUS], remap_failure[MAX_GPUS], mig_mode[MAX_GPUS];
static int init_delay_ms, open_delay_ms, index_error, field_type = 1;
static struct { int gpu; unsigned long long code; } events[MAX_EVENTS];
static int events_head, events_tail;
static atomic_int register_error[MAX_GPUS], registered[MAX_GPUS], new_calls_unsupported[MAX_GPUS];
static atomic_int sets_made, sets_freed;

/* -- controls --------------------------------------------------------------------------- */
void fake_configure(int count) {
    gpu_count = count < MAX_GPUS ? count : MAX_GPUS;
    for (int i = 0; i < MAX_GPUS; i++) devices[i].index = i;
    configured = 1;
}
void fake_wedge(int gpu, int on) { atomic_store(&wedged[gpu], on); }
void fake_fail(int gpu, int nvml_error) { atomic_store(&error_of[gpu], nvml_error); }
long fake_calls(int gpu) { return atomic_load(&calls[gpu]); }
void fake_delays(int init_ms, int open_ms) { init_delay_ms = init_ms; open_delay_ms = open_ms; }
void fake_index_error(int nvml_error) { index_error = nvml_error; }
void fake_remap(int gpu, int pending, int failure) { remap_pending[gpu] = pending; remap_failure[gpu] = failure; }
void fake_mig(int gpu, int on) { mig_mode[gpu] = on; }
void fake_field_type(int type) { field_type = type; }
void fake_register_error(int gpu, int nvml_error) { atomic_store(&register_error[gpu], nvml_error); }
int fake_registered(int gpu) { return atomic_load(&registered[gpu]); }
void fake_new_calls_unsupported(int gpu, int on) { atomic_store(&new_calls_unsupported[gpu], on); }
int fake_sets_made(void) { return atomic_load(&sets_made); }
int fake_sets_freed(void) { return atomic_load(&sets_freed); }
void fake_push_xid(int gpu, unsigned long long code) {
    if (!atomic_load(&registered[gpu])) return;  /* not recorded: nobody listens for it */
    events[events_tail % MAX_EVENTS].gpu = gpu;
    events[events_tail % MAX_EVENTS].code = code;
    events_tail++;
}

/* Every per-GPU call passes here: counted, blocked while wedged, failed when told to. */
static int enter(device_t *device) {
    if (device == NULL || device->index < 0 || device->index >= gpu_count) return INVALID_ARGUMENT;
    int gpu = device->index;
    atomic_fetch_add(&calls[gpu], 1);
    while (atomic_load(&wedged[gpu])) usleep(1000);
    return atomic_load(&error_of[gpu]);
}
#define ENTER(device) do { int rc_ = enter(device); if (rc_) return rc_; } while (0)

/* -- set-up ----------------------------------------------------------------------------- */
int nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    if (!configured) fake_configure(gpu_count);
    usleep(init_delay_ms * 1000);
    return SUCCESS;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { return SUCCESS; }
const char *nvmlErrorString(int result) {
    static char text[64];
    snprintf(text, sizeof text, "fake NVML error %d", result);
    return text;
}
int nvmlDeviceGetCount_v2(unsigned *count) { *count = gpu_count; return SUCCESS; }
int nvmlDeviceGetHandleByIndex_v2(unsigned index, device_t **device) {
    if (index >= (unsigned)gpu_count) return INVALID_ARGUMENT;
    usleep(open_delay_ms * 1000);
    ENTER(&devices[index]);
    *device = &devices[index];
    return SUCCESS;
}
int nvmlDeviceGetIndex(device_t *device, unsigned *index) {
    if (index_error) return index_error;
    ENTER(device);
    *index = device->index;
    return SUCCESS;
}
static void uuid_of(int gpu, char *out, unsigned size) {
    snprintf(out, size, "GPU-%08x-0000-4000-8000-%012x", 0xfeed0000 + gpu, gpu);
}
int nvmlDeviceGetUUID(device_t *device, char *uuid, unsigned size) {
    ENTER(device);
    uuid_of(device->index, uuid, size);
    return SUCCESS;
}
int nvmlDeviceGetHandleByUUID(const char *uuid, device_t **device) {
    char text[96];
    for (int i = 0; i < gpu_count; i++) {
        uuid_of(i, text, sizeof text);
        if (strcmp(text, uuid) == 0) { *device = &devices[i]; return SUCCESS; }
    }
    return INVALID_ARGUMENT;
}
int nvmlDeviceGetMigMode(device_t *device, unsigned *current, unsigned *pending) {
    ENTER(device);
    if (mig_mode[device->index] < 0) return NOT_SUPPORTED;
    *current = *pending = mig_mode[device->index];
    return SUCCESS;
}
int nvmlSystemGetDriverVersion(char *version, unsigned size) {
    snprintf(version, size, "570.124.06");
    return SUCCESS;
}

/* -- reads ------------------------------------------------------------------------------ */
int nvmlDeviceGetName(device_t *device, char *name, unsigned size) {
    ENTER(device);
    snprintf(name, size, "Fake H100 80GB HBM3");
    return SUCCESS;
}
#ifndef OLD_DRIVER
int nvmlDeviceGetTemperatureV(device_t *device, temperature_v1_t *temperature) {
    ENTER(device);
    if (atomic_load(&new_calls_unsupported[device->index])) return NOT_SUPPORTED;
    temperature->temperature = 60 + device->index;
    return SUCCESS;
}
#endif
int nvmlDeviceGetTemperature(device_t *device, unsigned sensor, unsigned *temperature) {
    (void)sensor;
    ENTER(device);
    *temperature = 50 + device->index;  /* differs from V on purpose: the test sees which ran */
    return SUCCESS;
}
int nvmlDeviceGetPowerUsage(device_t *device, unsigned *milliwatts) {
    ENTER(device); *milliwatts = 300000; return SUCCESS;
}
int nvmlDeviceGetUtilizationRates(device_t *device, utilization_t *utilization) {
    ENTER(device); utilization->gpu = 97; utilization->memory = 40; return SUCCESS;
}
int nvmlDeviceGetMemoryInfo(device_t *device, memory_t *memory) {
    ENTER(device);
    memory->total = 80ULL << 30; memory->used = 1ULL << 30; memory->free = memory->total - memory->used;
    return SUCCESS;
}
int nvmlDeviceGetTotalEccErrors(device_t *device, unsigned type, unsigned counter, unsigned long long *count) {
    ENTER(device); *count = type == 0 ? 5 : (counter == 1 ? 2 : 0); return SUCCESS;
}
#ifndef OLD_DRIVER
int nvmlDeviceGetCurrentClocksEventReasons(device_t *device, unsigned long long *reasons) {
    ENTER(device);
    if (atomic_load(&new_calls_unsupported[device->index])) return NOT_SUPPORTED;
    *reasons = 0x4; return SUCCESS;
}
#endif
int nvmlDeviceGetCurrentClocksThrottleReasons(device_t *device, unsigned long long *reasons) {
    ENTER(device); *reasons = 0x1; return SUCCESS;
}
int nvmlDeviceGetEnforcedPowerLimit(device_t *device, unsigned *milliwatts) {
    ENTER(device); *milliwatts = 700000; return SUCCESS;
}
int nvmlDeviceGetClockInfo(device_t *device, unsigned type, unsigned *mhz) {
    (void)type; ENTER(device); *mhz = 1980; return SUCCESS;
}
int nvmlDeviceGetPcieReplayCounter(device_t *device, unsigned *count) {
    ENTER(device); *count = 3; return SUCCESS;
}
int nvmlDeviceGetRetiredPagesPendingStatus(device_t *device, unsigned *pending) {
    (void)pending; ENTER(device); return NOT_SUPPORTED;  /* as on Ampere and later */
}
int nvmlDeviceGetRemappedRows(device_t *device, unsigned *corrected, unsigned *uncorrected,
                              unsigned *pending, unsigned *failure) {
    ENTER(device);
    *corrected = 0; *uncorrected = 0;
    *pending = remap_pending[device->index]; *failure = remap_failure[device->index];
    return SUCCESS;
}
int nvmlDeviceGetFieldValues(device_t *device, int count, field_value_t *values) {
    ENTER(device);
    for (int i = 0; i < count; i++) {
        values[i].nvml_return = SUCCESS;
        values[i].value_type = field_type;
        values[i].value.ull = 0;
        if (field_type == 6) values[i].value.us = 2; else values[i].value.ui = 0;
    }
    return SUCCESS;
}

/* -- XID events ------------------------------------------------------------------------- */
static int event_set_token;
static void forget_registrations(void) {
    for (int i = 0; i < MAX_GPUS; i++) atomic_store(&registered[i], 0);
    events_head = events_tail;  /* a freed set's events go with it */
}
int nvmlEventSetCreate(void **set) {
    atomic_fetch_add(&sets_made, 1); forget_registrations(); *set = &event_set_token; return SUCCESS;
}
int nvmlDeviceRegisterEvents(device_t *device, unsigned long long types, void *set) {
    (void)types; (void)set; ENTER(device);
    int rc = atomic_load(&register_error[device->index]);
    if (rc) return rc;
    atomic_store(&registered[device->index], 1);
    return SUCCESS;
}
int nvmlEventSetWait_v2(void *set, event_data_t *data, unsigned timeout_ms) {
    (void)set; (void)timeout_ms;
    if (events_head == events_tail) return TIMEOUT;
    int slot = events_head++ % MAX_EVENTS;
    data->device = &devices[events[slot].gpu];
    data->event_type = 8;
    data->event_data = events[slot].code;
    data->gpu_instance = data->compute_instance = 0xFFFFFFFF;
    return SUCCESS;
}
int nvmlEventSetFree(void *set) {
    (void)set; atomic_fetch_add(&sets_freed, 1); forget_registrations(); return SUCCESS;
}
