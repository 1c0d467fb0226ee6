// A preloadable CUPTI activity tracer (the device machine has no Nsight Systems): every kernel
// (graph kernels one by one), copy, memset and CUDA runtime call of the process, with GPU
// start and end on CUPTI's clock, written as CSV at exit for bench/step_timeline.py
// (its CSV input). Built with the CUDA build as build/libml4_cupti_trace.so (target
// ml4_cupti_trace); scripts/gpu_check_all.sh packs it with its libcupti:
//   ML4_BENCH_TRACE_STEP=1 ML4_CUPTI_OUT=trace.csv LD_PRELOAD=libml4_cupti_trace.so ml4 bench step ...
// Columns: kind (K kernel, C copy, S memset, R runtime call), start_ns, end_ns, stream,
// correlation, graph_node, name.
#include <cupti.h>

#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = size_t{8} << 20;

struct Row {
  char kind;
  uint64_t start, end;
  uint32_t stream, corr;
  uint64_t node;
  std::string name;
};

std::mutex g_mu;
std::vector<Row> g_rows;

std::string demangle(const char* n) {
  if (n == nullptr) return "?";
  int st = 0;
  char* d = abi::__cxa_demangle(n, nullptr, nullptr, &st);
  std::string s = st == 0 && d != nullptr ? d : n;
  std::free(d);
  return s;
}

// Every CUPTI call's failure is reported (the nineteenth and twenty-first sessions' traces held
// no activity at all, and the calls' results were then ignored).
bool check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return true;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "cupti_trace: %s failed: %s (%d)\n", what, msg ? msg : "?", static_cast<int>(r));
  return false;
}

void CUPTIAPI requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::vector<Row> rows;
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        auto* k = reinterpret_cast<CUpti_ActivityKernel10*>(rec);
        rows.push_back({'K', k->start, k->end, k->streamId, k->correlationId, k->graphNodeId, demangle(k->name)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        auto* m = reinterpret_cast<CUpti_ActivityMemcpy6*>(rec);
        rows.push_back({'C', m->start, m->end, m->streamId, m->correlationId, m->graphNodeId,
                        "memcpy kind " + std::to_string(m->copyKind) + " " + std::to_string(m->bytes) + " B"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        auto* m = reinterpret_cast<CUpti_ActivityMemset4*>(rec);
        rows.push_back({'S', m->start, m->end, m->streamId, m->correlationId, m->graphNodeId, "memset"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        auto* a = reinterpret_cast<CUpti_ActivityAPI*>(rec);
        const char* name = nullptr;
        cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &name);
        rows.push_back({'R', a->start, a->end, 0, a->correlationId, 0, name ? name : "?"});
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
  std::lock_guard<std::mutex> lock(g_mu);
  g_rows.insert(g_rows.end(), rows.begin(), rows.end());
}

bool g_written = false;

void write_out() {
  const char* out = std::getenv("ML4_CUPTI_OUT");
  if (out == nullptr || g_written) return;
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  {
    // A process without CUDA work leaves the file alone: LD_PRELOAD reaches every process of
    // the command line (`timeout ... ml4` loads the tracer into timeout too, which exits last
    // and, before this check, overwrote ml4's trace with an empty one).
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_rows.empty()) return;
  }
  std::FILE* f = std::fopen(out, "w");
  if (f == nullptr) return;
  g_written = true;
  std::fprintf(f, "kind,start_ns,end_ns,stream,correlation,graph_node,name\n");
  std::lock_guard<std::mutex> lock(g_mu);
  for (const Row& r : g_rows) {
    std::string n = r.name;
    for (char& c : n)
      if (c == ',' || c == '"' || c == '\n') c = ';';
    std::fprintf(f, "%c,%llu,%llu,%u,%u,%llu,%s\n", r.kind, static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.stream, r.corr, static_cast<unsigned long long>(r.node),
                 n.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "cupti_trace: %zu activities written to %s\n", g_rows.size(), out);
}

// The file is written at exit. Leaving cudaProfilerStop registers an atexit handler: handlers
// run in reverse order of registration, so this one runs before the CUDA runtime's (registered
// at the program's first CUDA call) tears the context down, and nothing is flushed from inside
// a CUPTI callback. A program that never calls cudaProfilerStop is written by the tracer's
// destructor (whatever CUPTI delivered by then).
void CUPTIAPI on_api(void*, CUpti_CallbackDomain domain, CUpti_CallbackId cbid, const void* data) {
  const auto* info = static_cast<const CUpti_CallbackData*>(data);
  static bool registered = false;
  if (domain == CUPTI_CB_DOMAIN_RUNTIME_API && cbid == CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000 &&
      info->callbackSite == CUPTI_API_EXIT && !registered) {
    registered = true;
    std::atexit(write_out);
  }
}

struct Tracer {
  Tracer() {
    if (std::getenv("ML4_CUPTI_OUT") == nullptr) return;
    uint32_t version = 0;
    if (check(cuptiGetVersion(&version), "cuptiGetVersion"))
      std::fprintf(stderr, "cupti_trace: CUPTI API version %u\n", version);
    CUpti_SubscriberHandle sub;
    if (check(cuptiSubscribe(&sub, on_api, nullptr), "cuptiSubscribe"))
      check(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RUNTIME_API, CUPTI_RUNTIME_TRACE_CBID_cudaProfilerStop_v4000),
            "cuptiEnableCallback");
    check(cuptiActivityRegisterCallbacks(requested, completed), "cuptiActivityRegisterCallbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable CONCURRENT_KERNEL");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable MEMCPY");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable MEMSET");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable RUNTIME");
  }
  ~Tracer() { write_out(); }
};

Tracer g_tracer;

}  // namespace
