// flight_recorder.cpp - see flight_recorder.hpp.
#include <Python.h> // the GIL: released while a failure waits for its dump

#include "flight_recorder.hpp"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <c10/util/thread_name.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include "work.hpp"

namespace tccomm {

// ---- settings ---------------------------------------------------------------

namespace {

struct Settings {
  size_t capacity = 0; // 0: off
  std::string prefix = "/tmp/nccl_trace_rank_";
  bool stacks = true;
  int signal = 0; // 0: no dump on a signal
};

const char* firstEnv(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      return v;
    }
  }
  return nullptr;
}

int signalNamed(std::string name) {
  if (name.rfind("SIG", 0) == 0) {
    name = name.substr(3);
  }
  if (name == "USR1") {
    return SIGUSR1;
  }
  if (name == "USR2") {
    return SIGUSR2;
  }
  char* end = nullptr;
  const long n = std::strtol(name.c_str(), &end, 10);
  return (end != name.c_str() && *end == '\0' && n > 0 && n < NSIG) ? static_cast<int>(n) : -1;
}

// Read once per process, as torch reads its own.
Settings readSettings() {
  Settings s;
  if (const char* v = firstEnv({"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"})) {
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || n < 0) {
      std::fprintf(stderr, "tccomm: TORCH_FR_BUFFER_SIZE='%s' is not a number of entries: flight recorder off\n", v);
    } else {
      s.capacity = static_cast<size_t>(n);
    }
  }
  if (const char* v = firstEnv({"TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"})) {
    s.prefix = v;
  }
  if (const char* v = std::getenv("TORCH_INCLUDE_STACK_TRACE")) {
    s.stacks = !(std::strcmp(v, "0") == 0 || strcasecmp(v, "false") == 0);
  }
  if (const char* v = firstEnv({"TCCOMM_FR_DUMP_SIGNAL"})) {
    s.signal = signalNamed(v);
    if (s.signal < 0) {
      std::fprintf(stderr, "tccomm: TCCOMM_FR_DUMP_SIGNAL='%s' is not a signal (USR1, USR2 or a number): ignored\n", v);
      s.signal = 0;
    }
  }
  return s;
}

const Settings& settings() {
  static const Settings s = readSettings();
  return s;
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Every recorder of the process, for dumps. Weak: a destroyed group's ring
// goes with its backend and its last works.
std::mutex registryMutex;
std::vector<std::weak_ptr<GroupRecorder>> registry;
std::atomic<uint64_t> nextRecordId{0}; // process-wide, as torch's record_id
std::atomic<uint64_t> nextUid{0};

// Starts the thread that writes dumps on failure and on the signal (once).
void startDumper();

} // namespace

// ---- the ring -----------------------------------------------------------------

struct GroupRecorder::Entry {
  uint64_t slot = UINT64_MAX; // the record's number in this ring
  uint64_t recordId = 0;
  int64_t collectiveSeq = 0;
  int64_t p2pSeq = 0;
  int64_t opId = 0;
  std::string name; // "gloo:all_reduce", "nccl:send 0->1", ...
  bool p2p = false;
  std::vector<std::vector<int64_t>> inSizes, outSizes;
  std::vector<at::ScalarType> inTypes, outTypes;
  int64_t createdNs = 0;
  std::optional<int64_t> startedNs, completedNs;
  int64_t timeoutMs = 0;
  bool retired = false;
  bool failed = false;
  std::vector<c10::weak_intrusive_ptr<PendingOp>> ops;
  std::shared_ptr<torch::CapturedTraceback> stack;
  std::string threadId, threadName;
};

struct GroupRecorder::Snapshot {
  GroupIdentity identity;
  uint64_t uid = 0;
  std::vector<Entry> entries; // oldest first
};

GroupRecorder::GroupRecorder(size_t capacity, uint64_t uid) : capacity_(capacity), uid_(uid) {
  ring_.resize(capacity);
}

GroupRecorder::~GroupRecorder() = default;

void GroupRecorder::setIdentity(const GroupIdentity& identity) {
  std::lock_guard<std::mutex> lock(mutex_);
  identity_ = std::make_unique<GroupIdentity>(identity);
}

namespace {

std::vector<int64_t> shapeOf(const at::Tensor& t, int64_t leading = 0) {
  std::vector<int64_t> shape;
  if (leading > 0) {
    shape.push_back(leading);
  }
  if (t.defined()) {
    const auto sizes = t.sizes();
    shape.insert(shape.end(), sizes.begin(), sizes.end());
  }
  return shape;
}

// One recorded side (inputs or outputs): each tensor's shape, with
// `leading` in front when not 0, and dtype.
void describeSide(
    std::vector<std::vector<int64_t>>& sizes,
    std::vector<at::ScalarType>& types,
    const std::vector<at::Tensor>& tensors,
    int64_t leading) {
  for (const auto& t : tensors) {
    sizes.push_back(shapeOf(t, leading));
    types.push_back(t.defined() ? t.scalar_type() : at::kByte);
  }
}

// Sizes as torch's analyzer expects them: one entry per tensor, except that
// the list forms of all_gather and reduce_scatter describe the gathered
// (scattered) side as the one [size, ...] tensor per input (output) that
// nccl moves.
void describeTensors(GroupRecorder::Entry& e, const OpParams& op, int64_t groupSize) {
  using c10d::OpType;
  static const std::vector<at::Tensor> none;
  const auto& inputs = op.inputs != nullptr ? *op.inputs : none;
  const auto& outputs = op.outputs != nullptr ? *op.outputs : none;
  const bool gathers = op.type == OpType::ALLGATHER || op.type == OpType::ALLGATHER_COALESCED;
  const bool scatters = op.type == OpType::REDUCE_SCATTER;
  if (scatters) {
    describeSide(e.inSizes, e.inTypes, outputs, groupSize);
  } else {
    describeSide(e.inSizes, e.inTypes, inputs, 0);
  }
  if (gathers) {
    describeSide(e.outSizes, e.outTypes, inputs, groupSize);
  } else {
    describeSide(e.outSizes, e.outTypes, outputs, 0);
  }
}

// Whether the core started any of an op's core ops (one that is gone has
// finished, so it started).
bool anyStarted(const std::vector<c10::weak_intrusive_ptr<PendingOp>>& ops) {
  for (const auto& weak : ops) {
    auto pending = weak.lock();
    if (!pending || tcc_op_started(pending->handle())) {
      return true;
    }
  }
  return false;
}

std::string p2pName(const std::string& base, c10d::OpType type, int rank, int peer) {
  if (type == c10d::OpType::SEND) {
    return c10::str(base, " ", rank, "->", peer);
  }
  return c10::str(base, " ", rank, "<-", peer); // receive: "dst<-src"
}

} // namespace

std::shared_ptr<GroupRecorder> GroupRecorder::create() {
  const Settings& s = settings();
  if (s.capacity == 0) {
    return nullptr;
  }
  startDumper();
  auto recorder = std::make_shared<GroupRecorder>(s.capacity, nextUid.fetch_add(1));
  std::lock_guard<std::mutex> lock(registryMutex);
  registry.erase(
      std::remove_if(registry.begin(), registry.end(), [](const auto& w) { return w.expired(); }), registry.end());
  registry.push_back(recorder);
  return recorder;
}

std::shared_ptr<torch::CapturedTraceback> GroupRecorder::captureStack() {
  if (!settings().stacks) {
    return nullptr;
  }
  return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, /*cpp=*/false);
}

RecorderTicket GroupRecorder::record(
    const RecordedOp& op,
    const std::vector<c10::intrusive_ptr<PendingOp>>& ops,
    std::shared_ptr<torch::CapturedTraceback> stack) {
  Entry e;
  e.recordId = nextRecordId.fetch_add(1);
  e.collectiveSeq = op.collectiveSeq;
  e.p2pSeq = op.p2pSeq;
  e.p2p = op.op->p2p;
  e.createdNs = nowNs();
  e.timeoutMs = op.timeout.count();
  for (const auto& pending : ops) {
    e.ops.emplace_back(pending);
  }
  std::ostringstream tid;
  tid << std::this_thread::get_id();
  e.threadId = tid.str();
  e.threadName = c10::getThreadName();
  e.stack = std::move(stack);
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t size = identity_ ? identity_->size : 1;
  const int rank = identity_ ? identity_->rank : 0;
  describeTensors(e, *op.op, size);
  const std::string base = c10::str(op.cuda ? "nccl:" : "gloo:", opNames(op.op->type).recorder);
  e.name = e.p2p ? p2pName(base, op.op->type, rank, op.op->peer) : base;
  e.slot = recorded_++;
  e.opId = static_cast<int64_t>(e.slot) + 1;
  const uint64_t slot = e.slot;
  ring_[slot % capacity_] = std::move(e);
  return RecorderTicket{shared_from_this(), slot};
}


void GroupRecorder::retire(uint64_t slot, bool failed, int anySource) {
  const int64_t now = nowNs();
  std::lock_guard<std::mutex> lock(mutex_);
  Entry& e = ring_[slot % capacity_];
  if (e.slot != slot) {
    return; // overwritten by newer ops already
  }
  e.retired = true;
  e.failed = failed;
  if (!e.startedNs && (!failed || anyStarted(e.ops))) {
    e.startedNs = now; // discovered now: a completed op started by then at the latest
  }
  e.ops.clear();
  if (!failed) {
    e.completedNs = now;
  }
  if (anySource >= 0 && e.p2p) {
    const int rank = identity_ ? identity_->rank : 0;
    e.name = p2pName(e.name.substr(0, e.name.find(' ')), c10d::OpType::RECV, rank, anySource);
  }
}

GroupRecorder::Snapshot GroupRecorder::snapshot() {
  const int64_t now = nowNs();
  Snapshot snap;
  snap.uid = uid_;
  std::lock_guard<std::mutex> lock(mutex_);
  if (identity_) {
    snap.identity = *identity_;
  }
  const uint64_t first = recorded_ > capacity_ ? recorded_ - capacity_ : 0;
  for (uint64_t slot = first; slot < recorded_; ++slot) {
    Entry& e = ring_[slot % capacity_];
    if (!e.retired && !e.startedNs && anyStarted(e.ops)) {
      e.startedNs = now; // discovered now
    }
    snap.entries.push_back(e);
    snap.entries.back().ops.clear();
  }
  return snap;
}

// ---- dumps ---------------------------------------------------------------------

namespace {

using Dict = c10::impl::GenericDict;

// Dumps are dicts of strings to anything, as torch's.
Dict newDict() {
  return Dict(c10::StringType::get(), c10::AnyType::get());
}

c10::IValue sizesValue(const std::vector<std::vector<int64_t>>& sizes) {
  c10::impl::GenericList list(c10::ListType::ofInts());
  for (const auto& s : sizes) {
    list.push_back(c10::IValue(s));
  }
  return list;
}

c10::IValue dtypesValue(const std::vector<at::ScalarType>& types) {
  std::vector<std::string> names;
  for (auto t : types) {
    names.emplace_back(c10::toString(t));
  }
  return c10::IValue(names);
}

c10::IValue optionalNs(const std::optional<int64_t>& ns) {
  return ns ? c10::IValue(*ns) : c10::IValue();
}

std::string ranksText(const GroupIdentity& id) {
  std::string text = "[";
  for (int r = 0; r < id.size; ++r) {
    const uint64_t global = id.globalRanks.empty() ? static_cast<uint64_t>(r) : id.globalRanks[r];
    text += (r ? ", " : "") + std::to_string(global);
  }
  return text + "]";
}

bool pythonUsable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing(); // public from 3.13 on
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

// The frames of every captured stack, as torch's dump lists them.
std::vector<c10::IValue> framesOf(const std::vector<const GroupRecorder::Entry*>& entries) {
  std::vector<c10::IValue> frames(entries.size(), c10::IValue(c10::impl::GenericList(c10::AnyType::get())));
  std::vector<torch::CapturedTraceback*> stacks;
  std::vector<size_t> owner;
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i]->stack) {
      stacks.push_back(entries[i]->stack.get());
      owner.push_back(i);
    }
  }
  if (stacks.empty() || !pythonUsable()) {
    return frames;
  }
  const torch::SymbolizedTracebacks symbolized = torch::symbolize(stacks);
  for (size_t k = 0; k < symbolized.tracebacks.size() && k < owner.size(); ++k) {
    c10::impl::GenericList list(c10::AnyType::get());
    for (uint64_t index : symbolized.tracebacks[k]) {
      const auto& f = symbolized.all_frames.at(index);
      Dict frame = newDict();
      frame.insert("name", f.funcname);
      frame.insert("filename", f.filename);
      frame.insert("line", static_cast<int64_t>(f.lineno));
      list.push_back(frame);
    }
    frames[owner[k]] = list;
  }
  return frames;
}

Dict entryValue(const GroupRecorder::Entry& e, const GroupRecorder::Snapshot& group, c10::IValue frames) {
  Dict d = newDict();
  d.insert("record_id", static_cast<int64_t>(e.recordId));
  d.insert("pg_id", static_cast<int64_t>(group.uid));
  d.insert("process_group", c10::ivalue::Tuple::create(group.identity.name, group.identity.desc));
  d.insert("collective_seq_id", e.collectiveSeq);
  d.insert("p2p_seq_id", e.p2pSeq);
  d.insert("op_id", e.opId);
  d.insert("profiling_name", e.name);
  d.insert("time_created_ns", e.createdNs);
  d.insert("input_sizes", sizesValue(e.inSizes));
  d.insert("input_dtypes", dtypesValue(e.inTypes));
  d.insert("output_sizes", sizesValue(e.outSizes));
  d.insert("output_dtypes", dtypesValue(e.outTypes));
  const char* state = e.completedNs ? "completed" : e.startedNs ? "started" : "scheduled";
  d.insert("state", state);
  d.insert("time_discovered_started_ns", optionalNs(e.startedNs));
  d.insert("time_discovered_completed_ns", optionalNs(e.completedNs));
  d.insert("retired", e.retired);
  d.insert("timeout_ms", e.timeoutMs);
  d.insert("is_p2p", e.p2p);
  d.insert("thread_id", e.threadId);
  d.insert("thread_name", e.threadName);
  d.insert("frames", std::move(frames));
  return d;
}

Dict groupStatus(const GroupRecorder::Snapshot& group) {
  int64_t enqueued = -1, started = -1, completed = -1;
  for (const auto& e : group.entries) {
    if (e.p2p) {
      continue;
    }
    enqueued = std::max(enqueued, e.collectiveSeq);
    if (e.startedNs) {
      started = std::max(started, e.collectiveSeq);
    }
    if (e.completedNs) {
      completed = std::max(completed, e.collectiveSeq);
    }
  }
  Dict d = newDict();
  d.insert("last_enqueued_collective", enqueued);
  d.insert("last_started_collective", started);
  d.insert("last_completed_collective", completed);
  return d;
}

// A plain pickle (protocol 2, no type tags, no tensors), as torch's
// recorder writes: what Python's pickle.load reads.
std::vector<char> plainPickle(const c10::IValue& value) {
  std::vector<char> bytes;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t size) { bytes.insert(bytes.end(), data, data + size); },
      nullptr,
      nullptr,
      nullptr,
      nullptr,
      /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  return bytes;
}

std::string tcommVersion() {
  return "tccomm 0.1.0";
}

// The pickled dump of every live group, and this process's global rank.
std::pair<std::vector<char>, int64_t> buildDump() {
  std::vector<GroupRecorder::Snapshot> groups;
  {
    std::vector<std::shared_ptr<GroupRecorder>> live;
    {
      std::lock_guard<std::mutex> lock(registryMutex);
      for (const auto& weak : registry) {
        if (auto r = weak.lock()) {
          live.push_back(std::move(r));
        }
      }
    }
    for (const auto& r : live) {
      groups.push_back(r->snapshot());
    }
  }
  int64_t globalRank = -1;
  Dict pgConfig = newDict();
  Dict pgStatus = newDict();
  std::vector<std::pair<const GroupRecorder::Entry*, const GroupRecorder::Snapshot*>> all;
  for (const auto& g : groups) {
    const GroupIdentity& id = g.identity;
    if (id.name.empty()) {
      continue; // never issued an op
    }
    if (globalRank < 0) {
      globalRank = id.globalRanks.empty() ? id.rank : static_cast<int64_t>(id.globalRanks.at(id.rank));
    }
    Dict config = newDict();
    config.insert("name", id.name);
    config.insert("desc", id.desc);
    config.insert("ranks", ranksText(id));
    pgConfig.insert(id.name, config);
    pgStatus.insert(id.name, groupStatus(g));
    for (const auto& e : g.entries) {
      all.emplace_back(&e, &g);
    }
  }
  if (globalRank < 0) {
    const char* rank = std::getenv("RANK");
    globalRank = rank != nullptr ? std::atoll(rank) : 0;
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first->recordId < b.first->recordId; });
  std::vector<const GroupRecorder::Entry*> entries;
  for (const auto& [e, g] : all) {
    entries.push_back(e);
  }
  std::vector<c10::IValue> frames = framesOf(entries);
  c10::impl::GenericList list(c10::AnyType::get());
  for (size_t i = 0; i < all.size(); ++i) {
    list.push_back(entryValue(*all[i].first, *all[i].second, std::move(frames[i])));
  }
  Dict dump = newDict();
  dump.insert("version", "2.10"); // the format of torch's recorder this follows
  dump.insert("comm_lib_version", tcommVersion());
  dump.insert("pg_config", pgConfig);
  dump.insert("pg_status", pgStatus);
  dump.insert("entries", list);
  return {plainPickle(dump), globalRank};
}

// The dumper thread: failure and signal dumps are written here, never on
// the thread that reports the failure (an engine thread) or in a handler.
std::once_flag dumperStarted;
int wakePipe[2] = {-1, -1};
std::mutex failureMutex;
std::condition_variable failureCv;
bool failureRequested = false; // guarded by failureMutex
bool failureDumped = false;    // guarded by failureMutex

void wake(char why) {
  const int saved = errno;
  ssize_t n;
  do {
    n = write(wakePipe[1], &why, 1);
  } while (n < 0 && errno == EINTR);
  errno = saved;
}

void onDumpSignal(int) {
  wake('S');
}

void dumperLoop() {
  c10::setThreadName("tccomm-fr-dump");
  for (;;) {
    char why = 0;
    const ssize_t n = read(wakePipe[0], &why, 1);
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n <= 0) {
      return;
    }
    try {
      const std::string path = dumpFlightRecorder("");
      std::fprintf(stderr, "tccomm: flight recorder dumped to %s (%s)\n", path.c_str(),
                   why == 'F' ? "first failed op" : "signal");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tccomm: flight recorder dump failed: %s\n", e.what());
    }
    if (why == 'F') {
      std::lock_guard<std::mutex> lock(failureMutex);
      failureDumped = true;
      failureCv.notify_all();
    }
  }
}

void installDumpSignal(int sig) {
  struct sigaction old {};
  if (sigaction(sig, nullptr, &old) != 0) {
    return;
  }
  if (!(old.sa_flags & SA_SIGINFO) && old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN) {
    std::fprintf(stderr, "tccomm: TCCOMM_FR_DUMP_SIGNAL: signal %d already has a handler: not taken over\n", sig);
    return;
  }
  struct sigaction sa {};
  sa.sa_handler = onDumpSignal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(sig, &sa, nullptr);
}

void startDumper() {
  std::call_once(dumperStarted, [] {
    if (pipe2(wakePipe, O_CLOEXEC) != 0) {
      std::fprintf(stderr, "tccomm: flight recorder: no pipe (%s): no dumps on failure or signal\n",
                   std::strerror(errno));
      return;
    }
    std::thread(dumperLoop).detach(); // lives as long as the process, as torch's recorder
    if (settings().signal > 0) {
      installDumpSignal(settings().signal);
    }
  });
}

// Releases the GIL for its lifetime if this thread holds it (the dumper
// needs it to name the Python frames).
class GilReleased {
 public:
  GilReleased() {
    if (pythonUsable() && PyGILState_Check()) {
      state_ = PyEval_SaveThread();
    }
  }
  ~GilReleased() {
    if (state_ != nullptr) {
      PyEval_RestoreThread(state_);
    }
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_ = nullptr;
};

} // namespace

std::string dumpFlightRecorder(const std::string& path) {
  if (settings().capacity == 0) {
    return "";
  }
  auto [bytes, globalRank] = buildDump();
  const std::string target = path.empty() ? settings().prefix + std::to_string(globalRank) : path;
  // Written aside and renamed: a reader never sees half a dump.
  const std::string partial = target + ".partial";
  FILE* f = std::fopen(partial.c_str(), "wb");
  TORCH_CHECK(f != nullptr, "tccomm: flight recorder: cannot write ", partial, ": ", std::strerror(errno));
  const size_t written = std::fwrite(bytes.data(), 1, bytes.size(), f);
  const bool closed = std::fclose(f) == 0;
  if (written != bytes.size() || !closed) {
    std::remove(partial.c_str());
    TORCH_CHECK(false, "tccomm: flight recorder: writing ", partial, " failed: ", std::strerror(errno));
  }
  TORCH_CHECK(
      std::rename(partial.c_str(), target.c_str()) == 0,
      "tccomm: flight recorder: cannot rename ", partial, " to ", target, ": ", std::strerror(errno));
  return target;
}

void flightRecorderSawFailure() {
  if (settings().capacity == 0) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(failureMutex);
    if (failureRequested) {
      return; // the first failure's dump is the one that tells where ranks diverged
    }
    failureRequested = true;
  }
  startDumper();
  if (wakePipe[1] >= 0) {
    wake('F');
  } else {
    std::lock_guard<std::mutex> lock(failureMutex);
    failureDumped = true; // nothing will come
    failureCv.notify_all();
  }
}

void awaitFailureDump() {
  if (settings().capacity == 0) {
    return;
  }
  {
    std::lock_guard<std::mutex> lock(failureMutex);
    if (!failureRequested || failureDumped) {
      return;
    }
  }
  GilReleased released;
  std::unique_lock<std::mutex> lock(failureMutex);
  failureCv.wait_for(lock, std::chrono::minutes(1), [] { return failureDumped; });
}

} // namespace tccomm
