// The flight recorder: each process keeps a ring of its last N process-group
// operations, so that after a hang, a desync or a lost rank every rank can say
// what it issued, what it was running and what it finished (docs/debugging.md,
// "Seeing what a job's ranks were doing"; `dtrun analyze` reads the dumps).
//
// Contract:
//  * One ring per process, shared by every group, DT_FLIGHT_RECORDER_ENTRIES
//    entries (read once, at the first record; 0 turns the recorder off and
//    every call below into a load and a branch). CollectiveRunner records every
//    collective of every backend at issue and updates it when it starts and
//    ends; ProcessGroup records send, recv and batchIsendIrecv (their own
//    numbering, p2p_seq). The oldest entry is overwritten; an op still running
//    when N newer ops have been issued loses its record (its slot is reused).
//  * Recording costs no allocation and no lock: a slot is claimed with one
//    atomic increment of the shared counter (so entries are in the order the
//    ops were issued, across groups and threads) and written with relaxed
//    stores inside a per-slot sequence counter, which a dump uses to skip a
//    slot being written. Times of issue, start and end come from
//    CLOCK_MONOTONIC_COARSE for ops up to 1 MiB (its tick, a few ms, is the
//    resolution; a precise clock read costs more than the rest of the record)
//    and from CLOCK_MONOTONIC above.
//  * FlightContext: a thread-local "what caused this" tag copied into every op
//    issued on that thread while it lives ("ddp bucket 3", "pipeline SendF mb
//    2 stage 1"); scopes nest and restore the outer tag. Formatting happens
//    once per scope, into a fixed buffer (63 characters kept), never per op.
//  * Dumps: dumpFlightRecorder(reason) writes every entry, oldest first, as one
//    JSON document (format in docs/debugging.md) to
//    <dir>/flight_rank<R>_<reason>.json, written to a temporary name and
//    renamed, so a reader never sees half a file. <dir> is
//    DT_FLIGHT_RECORDER_DIR (dtrun sets it to the attempt's log folder under
//    --log-dir); without one nothing is written. A failure dump (timeout,
//    desync, error, abort, member_loss) is written at most once per reason per
//    process (the first cause is the one worth keeping); a dump on request or
//    on SIGUSR2 replaces the previous one of its reason.
//  * Never throws, never exits: a dump that cannot be written logs one warning
//    and returns "". Thread-safe; a dump may run while ops are recorded.
//  * SIGUSR2: flight::installSignalHandler() (the first CollectiveRunner
//    calls it) installs a handler only where the signal's disposition is
//    still the default (a program's own handler is left alone; a child forked
//    afterwards inherits it, and no longer dies of SIGUSR2). The handler only
//    sets an atomic flag (async-signal-safe);
//    every group's progress thread polls it once per progress interval (1 s by
//    default) and the first to see it writes the "signal" dump.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collectives/fingerprint.h"
#include "tensor/tensor.h"

namespace dt {

class FlightContext {
 public:
  // printf-style; the text is formatted here, once.
  explicit FlightContext(const char* format, ...) __attribute__((format(printf, 2, 3)));
  ~FlightContext();
  FlightContext(const FlightContext&) = delete;
  FlightContext& operator=(const FlightContext&) = delete;

  static constexpr size_t kBytes = 64;
  // This thread's current tag ("" when none).
  static const char* current();

 private:
  char saved_[kBytes];
};

// Writes this process's flight record now (see the contract) and returns the
// file's path, or "" when nothing was written (no directory, recorder off, a
// write error, or a failure dump of this reason already written). `detail`
// goes into the dump as the reason's explanation (an error's text).
std::string dumpFlightRecorder(const std::string& reason = "request", const std::string& detail = "");

namespace flight {

enum class State : uint8_t { Queued = 0, Running = 1, Done = 2, Failed = 3, Aborted = 4 };
const char* stateName(State state);

// Whether the recorder is on (DT_FLIGHT_RECORDER_ENTRIES > 0).
bool enabled();
// The ring's size (0: off).
size_t capacity();

// A collective at issue; returns the entry's id (0: not recorded).
// `group` must live as long as the process (Work::internName); `instance`
// tells a group made again under the same name from the one before. `nowNs`: the
// caller's clock reading (coarse), reused for small ops.
uint64_t recordCollective(const std::string* group, int instance, int rank, int size, uint64_t seq,
                          const char* op, const CollectiveFingerprint& fingerprint, size_t bytes, State state,
                          int64_t nowNs);
// A point-to-point op (or a batch of them: op "batchIsendIrecv", peer of the first) at issue.
uint64_t recordP2P(const std::string* group, int instance, int rank, int size, uint64_t p2pSeq,
                   const char* op, const std::vector<Tensor>& tensors, int peer);
void started(uint64_t id, int64_t nowNs);
void finished(uint64_t id, State state, int64_t nowNs);
// The clock readings the recorder uses: coarse for small ops, precise above 1 MiB.
int64_t clockNs(size_t bytes);

// A failure broke a group: the dump's reason from the error's type (timeout,
// desync, member_loss), else `fallback` ("error" for a failed op, "abort" for
// Backend::abort). Never throws.
void dumpOnFailure(const std::exception_ptr& cause, const char* fallback);

// SIGUSR2: see the contract. Idempotent.
void installSignalHandler();
// Called by progress threads: writes the "signal" dump if SIGUSR2 arrived.
void pollSignal();

}  // namespace flight
}  // namespace dt
