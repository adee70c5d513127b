// SPDX-License-Identifier: Apache-2.0
#include "io/file_io.h"

#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "core/logging.h"
#include "core/status.h"

namespace weightbus::internal {
namespace {

constexpr uint64_t kCancelTag = ~uint64_t{0};
constexpr uint64_t kFsyncTagBit = uint64_t{1} << 62;
// Every tag carries the pid of the process that queued the operation (bits 32..61), so that
// completions of another process sharing the ring (a forked child) are never taken for ours.
uint64_t PidTag() { return static_cast<uint64_t>(static_cast<uint32_t>(::getpid())) << 32; }
// io_uring and pread/pwrite move at most MAX_RW_COUNT (2 GiB - 4 KiB) per operation.
constexpr uint64_t kMaxOpBytes = (uint64_t{1} << 31) - 4096;

absl::Status ShortTransfer(bool write, const std::string& what, uint64_t at, uint64_t want) {
  if (write) {
    return absl::InternalError(
        absl::StrFormat("%s: write made no progress at byte %d (%d bytes left)", what, at, want));
  }
  return absl::DataLossError(absl::StrFormat(
      "%s is truncated: end of file at byte %d with %d bytes of the range still to read", what, at,
      want));
}

absl::Status Deadline(bool write, const std::string& what, absl::Time deadline) {
  return absl::DeadlineExceededError(absl::StrFormat("%s: %s did not finish by the deadline (%s)",
                                                     what, write ? "write" : "read",
                                                     absl::FormatTime(deadline)));
}

// At most this many pieces in one vectored operation (Linux's IOV_MAX).
constexpr size_t kMaxPieces = 1024;

// One operation: either a chunk of one request (count == 1, `offset` within it) or several whole
// requests that are contiguous in the same file (count > 1, offset 0), moved with one
// preadv/pwritev (IORING_OP_READV/WRITEV). Batching the latter is what makes the number of
// operations, and of io_uring submissions, follow the bytes rather than the number of tensors.
struct Op {
  size_t first = 0;
  size_t count = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// The next operation from position (*next_request, *next_offset), advancing it. Zero-length
// requests are skipped by the caller.
Op NextOp(absl::Span<const IoRequest> requests, size_t* next_request, uint64_t* next_offset,
          uint64_t chunk) {
  const IoRequest& r = requests[*next_request];
  Op op{*next_request, 1, *next_offset, std::min({chunk, r.length - *next_offset, kMaxOpBytes})};
  if (*next_offset == 0 && r.length < chunk) {
    // Gather the following small requests that continue this one in the same file.
    size_t k = *next_request + 1;
    uint64_t end = r.file_offset + r.length;
    while (k < requests.size() && op.count < kMaxPieces && requests[k].fd == r.fd &&
           requests[k].length > 0 && requests[k].file_offset == end &&
           op.length + requests[k].length <= chunk) {
      op.length += requests[k].length;
      end += requests[k].length;
      ++op.count;
      ++k;
    }
  }
  if (op.count > 1) {
    *next_request += op.count;
    *next_offset = 0;
  } else {
    *next_offset += op.length;
    if (*next_offset == r.length) {
      ++*next_request;
      *next_offset = 0;
    }
  }
  return op;
}

// The pieces of `op` that remain after its first `done` bytes, into *out.
void Pieces(absl::Span<const IoRequest> requests, const Op& op, uint64_t done,
            std::vector<iovec>* out) {
  out->clear();
  if (op.count == 1) {
    const IoRequest& r = requests[op.first];
    out->push_back(iovec{r.buffer + op.offset + done, static_cast<size_t>(op.length - done)});
    return;
  }
  for (size_t k = op.first; k < op.first + op.count; ++k) {
    const IoRequest& r = requests[k];
    if (done >= r.length) {
      done -= r.length;
      continue;
    }
    out->push_back(iovec{r.buffer + done, static_cast<size_t>(r.length - done)});
    done = 0;
  }
}

// The request that holds byte `done` of `op`, for messages.
size_t RequestAt(absl::Span<const IoRequest> requests, const Op& op, uint64_t done) {
  for (size_t k = op.first; k + 1 < op.first + op.count; ++k) {
    if (done < requests[k].length) return k;
    done -= requests[k].length;
  }
  return op.first + op.count - 1;
}

// Accounts a finished `op`: its requests are complete once all their bytes are.
void FinishOp(const Op& op, std::vector<uint64_t>& remaining,
              absl::FunctionRef<void(size_t)> on_complete) {
  if (op.count == 1) {
    remaining[op.first] -= op.length;
    if (remaining[op.first] == 0) on_complete(op.first);
    return;
  }
  for (size_t k = op.first; k < op.first + op.count; ++k) {
    remaining[k] = 0;
    on_complete(k);
  }
}

class PsyncFileIo final : public FileIo {
 public:
  explicit PsyncFileIo(uint64_t chunk) : chunk_(chunk) {}
  std::string_view name() const override { return "psync"; }
  FileIoCounters counters() const override { return counters_; }

  absl::Status Fsync(int fd, absl::Time deadline, std::string_view what) override {
    if (::fsync(fd) != 0) return ErrnoStatus(errno, absl::StrFormat("fsync %s", what));
    return absl::OkStatus();
  }

 private:
  absl::Status Transfer(bool write, absl::Span<const IoRequest> requests, absl::Time deadline,
                        absl::FunctionRef<void(size_t)> on_complete,
                        absl::FunctionRef<std::string(size_t)> describe) override {
    std::vector<uint64_t> remaining(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) remaining[i] = requests[i].length;
    std::vector<iovec> pieces;
    size_t next_request = 0;
    uint64_t next_offset = 0;
    while (next_request < requests.size()) {
      if (requests[next_request].length == 0) {
        on_complete(next_request++);
        continue;
      }
      const Op op = NextOp(requests, &next_request, &next_offset, chunk_);
      const IoRequest& r = requests[op.first];
      const uint64_t start = r.file_offset + op.offset;
      uint64_t done = 0;
      while (done < op.length) {
        if (absl::Now() > deadline) {
          return Deadline(write, describe(RequestAt(requests, op, done)), deadline);
        }
        Pieces(requests, op, done, &pieces);
        ++counters_.operations;
        ++counters_.submissions;
        ssize_t n = write ? ::pwritev(r.fd, pieces.data(), static_cast<int>(pieces.size()),
                                      static_cast<off_t>(start + done))
                          : ::preadv(r.fd, pieces.data(), static_cast<int>(pieces.size()),
                                     static_cast<off_t>(start + done));
        if (n < 0) {
          if (errno == EINTR || errno == EAGAIN) continue;
          return ErrnoStatus(errno, absl::StrFormat("%s: %s at file offset %d",
                                                    describe(RequestAt(requests, op, done)),
                                                    write ? "write" : "read", start + done));
        }
        if (n == 0) {
          const size_t at = RequestAt(requests, op, done);
          return ShortTransfer(write, describe(at), start + done, remaining[at]);
        }
        done += static_cast<uint64_t>(n);
      }
      FinishOp(op, remaining, on_complete);
    }
    return absl::OkStatus();
  }
  uint64_t chunk_;
  FileIoCounters counters_;
};

class UringFileIo final : public FileIo {
 public:
  UringFileIo(io_uring ring, unsigned depth, uint64_t chunk)
      : ring_(ring), depth_(depth), chunk_(chunk) {}
  ~UringFileIo() override {
    if (!poisoned_) io_uring_queue_exit(&ring_);
  }
  std::string_view name() const override { return "uring"; }
  FileIoCounters counters() const override { return counters_; }

  absl::Status Fsync(int fd, absl::Time deadline, std::string_view what) override {
    WB_RETURN_IF_ERROR(Ready());
    const uint64_t tag = kFsyncTagBit | PidTag() | (++fsync_serial_ & 0xffffffff);
    io_uring_sqe* sqe = GetSqe();
    if (sqe == nullptr) return NoSqe(absl::StrFormat("fsync %s", what));
    io_uring_prep_fsync(sqe, fd, 0);
    io_uring_sqe_set_data64(sqe, tag);
    ++counters_.operations;
    while (true) {
      io_uring_cqe* cqe = nullptr;
      int rc = SubmitAndWait(deadline, &cqe);
      if (rc == -ETIME) {
        // fsync cannot be interrupted once running; its late completion is ignored by tag.
        return absl::DeadlineExceededError(
            absl::StrFormat("fsync %s did not finish by the deadline", what));
      }
      if (rc == -EINTR) continue;
      if (rc < 0) return ErrnoStatus(-rc, absl::StrFormat("io_uring wait (fsync %s)", what));
      const uint64_t data = io_uring_cqe_get_data64(cqe);
      const int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data != tag) continue;  // a late completion of an abandoned operation
      if (res < 0) return ErrnoStatus(-res, absl::StrFormat("fsync %s", what));
      return absl::OkStatus();
    }
  }

 private:
  struct Slot {
    Op op;
    uint64_t done = 0;  // bytes of op already transferred (short transfers)
    bool busy = false;
    std::vector<iovec> pieces;  // what the operation in flight moves; alive until it completes
  };

  static absl::Status Poisoned() {
    return absl::InternalError(
        "io_uring instance unusable: operations from an earlier timed-out call never finished");
  }

  static absl::Status NoSqe(std::string_view what) {
    return absl::InternalError(absl::StrFormat(
        "%s: the io_uring submission queue has no free entry even after submitting (its shared "
        "state was changed from outside this call, e.g. by a forked child using the ring)",
        what));
  }

  // Called at the start of every call, when nothing of ours is in flight. A submission queue
  // whose kernel head has run past our tail was used by someone else (a forked child shares the
  // ring's memory): every io_uring_get_sqe would return NULL. The ring is then replaced by a
  // fresh one. Completions left in the queue belong to nobody waiting: they are dropped.
  absl::Status Ready() {
    if (poisoned_) return Poisoned();
    if (io_uring_sq_ready(&ring_) > ring_.sq.ring_entries) {
      const unsigned entries = ring_.sq.ring_entries;
      Log(LogLevel::kWarn,
          "io_uring submission queue out of step with this process (used by a forked child?); "
          "replacing the ring");
      io_uring_queue_exit(&ring_);
      const int rc = io_uring_queue_init(entries, &ring_, 0);
      if (rc < 0) {
        poisoned_ = true;  // nothing to free any more
        return ErrnoStatus(-rc, "io_uring_queue_init (replacing a ring used by another process)");
      }
    }
    if (const unsigned stale = io_uring_cq_ready(&ring_); stale > 0) {
      io_uring_cq_advance(&ring_, stale);
    }
    return absl::OkStatus();
  }

  // A free submission entry, or nullptr when there is none even after submitting what is
  // queued (never dereferenced by callers).
  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      if (io_uring_submit(&ring_) > 0) ++counters_.submissions;
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  // Submits queued SQEs and waits for one completion until `deadline`. Returns 0 with *cqe set,
  // -ETIME at the deadline, or another -errno.
  int SubmitAndWait(absl::Time deadline, io_uring_cqe** cqe) {
    int rc = io_uring_submit(&ring_);
    if (rc > 0) ++counters_.submissions;
    if (rc < 0 && rc != -EINTR && rc != -EBUSY && rc != -EAGAIN) return rc;
    absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    __kernel_timespec ts;
    ts.tv_sec = absl::ToInt64Seconds(left);
    ts.tv_nsec = absl::ToInt64Nanoseconds(left - absl::Seconds(ts.tv_sec));
    return io_uring_wait_cqe_timeout(&ring_, cqe, &ts);
  }

  // Queues what is left of slot `index`'s operation. False when no submission entry is free.
  bool Issue(bool write, absl::Span<const IoRequest> requests, size_t index, Slot& slot) {
    io_uring_sqe* sqe = GetSqe();
    if (sqe == nullptr) return false;
    const IoRequest& r = requests[slot.op.first];
    const uint64_t at = r.file_offset + slot.op.offset + slot.done;
    Pieces(requests, slot.op, slot.done, &slot.pieces);
    if (slot.pieces.size() == 1) {
      if (write) {
        io_uring_prep_write(sqe, r.fd, slot.pieces[0].iov_base,
                            static_cast<unsigned>(slot.pieces[0].iov_len), at);
      } else {
        io_uring_prep_read(sqe, r.fd, slot.pieces[0].iov_base,
                           static_cast<unsigned>(slot.pieces[0].iov_len), at);
      }
    } else if (write) {
      io_uring_prep_writev(sqe, r.fd, slot.pieces.data(), static_cast<unsigned>(slot.pieces.size()),
                           at);
    } else {
      io_uring_prep_readv(sqe, r.fd, slot.pieces.data(), static_cast<unsigned>(slot.pieces.size()),
                          at);
    }
    io_uring_sqe_set_data64(sqe, tag_ | index);
    ++counters_.operations;
    return true;
  }

  absl::Status Transfer(bool write, absl::Span<const IoRequest> requests, absl::Time deadline,
                        absl::FunctionRef<void(size_t)> on_complete,
                        absl::FunctionRef<std::string(size_t)> describe) override {
    WB_RETURN_IF_ERROR(Ready());
    tag_ = PidTag();
    std::vector<Slot> slots(depth_);
    std::vector<size_t> free_slots;
    for (size_t i = depth_; i-- > 0;) free_slots.push_back(i);
    std::vector<uint64_t> remaining(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) remaining[i] = requests[i].length;

    size_t next_request = 0;
    uint64_t next_offset = 0;
    unsigned inflight = 0;
    absl::Status error;
    auto where = [&](const Slot& slot) {
      return describe(RequestAt(requests, slot.op, slot.done));
    };
    auto no_sqe = [&](const Slot& slot) {
      if (error.ok()) error = NoSqe(where(slot));
    };

    while (true) {
      while (error.ok() && !free_slots.empty() && next_request < requests.size()) {
        if (requests[next_request].length == 0) {
          on_complete(next_request++);
          continue;
        }
        const size_t s = free_slots.back();
        Slot& slot = slots[s];
        slot.op = NextOp(requests, &next_request, &next_offset, chunk_);
        slot.done = 0;
        if (!Issue(write, requests, s, slot)) {
          no_sqe(slot);
          break;
        }
        free_slots.pop_back();
        slot.busy = true;
        ++inflight;
      }
      if (inflight == 0) break;

      io_uring_cqe* cqe = nullptr;
      int rc = SubmitAndWait(deadline, &cqe);
      if (rc == -EINTR) continue;
      if (rc == -ETIME) {
        if (absl::Now() < deadline) continue;
        size_t culprit = 0;
        for (const Slot& s : slots) {
          if (s.busy) {
            culprit = RequestAt(requests, s.op, s.done);
            break;
          }
        }
        CancelAndDrain(slots, inflight);
        return error.ok() ? Deadline(write, describe(culprit), deadline) : error;
      }
      if (rc < 0) {
        CancelAndDrain(slots, inflight);
        return ErrnoStatus(-rc, "io_uring wait");
      }
      unsigned head;
      unsigned seen = 0;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        const uint64_t tagged = io_uring_cqe_get_data64(cqe);
        if ((tagged & ~uint64_t{0xffffffff}) != tag_) continue;  // cancel, fsync, other process
        const uint64_t data = tagged & 0xffffffff;
        if (data >= slots.size() || !slots[data].busy) continue;  // abandoned op
        Slot& slot = slots[data];
        const int res = cqe->res;
        if (res == -EAGAIN || res == -EINTR) {
          if (error.ok()) {
            if (Issue(write, requests, data, slot)) continue;
            no_sqe(slot);
          }
        } else if (res < 0) {
          if (error.ok()) {
            const IoRequest& r = requests[slot.op.first];
            error = ErrnoStatus(-res, absl::StrFormat("%s: %s at file offset %d", where(slot),
                                                      write ? "write" : "read",
                                                      r.file_offset + slot.op.offset + slot.done));
          }
        } else if (res == 0) {
          if (error.ok()) {
            const size_t at = RequestAt(requests, slot.op, slot.done);
            const IoRequest& r = requests[slot.op.first];
            error = ShortTransfer(write, describe(at), r.file_offset + slot.op.offset + slot.done,
                                  remaining[at]);
          }
        } else {
          slot.done += static_cast<uint64_t>(res);
          if (slot.done < slot.op.length) {  // short transfer: issue the rest
            if (error.ok()) {
              if (Issue(write, requests, data, slot)) continue;
              no_sqe(slot);
            }
          } else {
            FinishOp(slot.op, remaining, on_complete);
          }
        }
        slot.busy = false;
        free_slots.push_back(data);
        --inflight;
      }
      io_uring_cq_advance(&ring_, seen);
    }
    return error;
  }

  // Cancels every busy slot and waits (bounded) for their completions; if they do not come,
  // the ring is abandoned rather than freed under the kernel's feet.
  void CancelAndDrain(std::vector<Slot>& slots, unsigned& inflight) {
    for (size_t i = 0; i < slots.size(); ++i) {
      if (!slots[i].busy) continue;
      io_uring_sqe* sqe = GetSqe();
      if (sqe == nullptr) break;  // the grace period below still waits for them
      io_uring_prep_cancel64(sqe, tag_ | i, 0);
      io_uring_sqe_set_data64(sqe, kCancelTag);
    }
    const absl::Time grace = absl::Now() + absl::Seconds(5);
    while (inflight > 0) {
      io_uring_cqe* cqe = nullptr;
      int rc = SubmitAndWait(grace, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) break;
      const uint64_t tagged = io_uring_cqe_get_data64(cqe);
      io_uring_cqe_seen(&ring_, cqe);
      const uint64_t data = tagged & 0xffffffff;
      if ((tagged & ~uint64_t{0xffffffff}) == tag_ && data < slots.size() && slots[data].busy) {
        slots[data].busy = false;
        --inflight;
      }
    }
    if (inflight > 0) {
      poisoned_ = true;
      Log(LogLevel::kError,
          "%d io_uring operations did not complete after cancellation; abandoning the ring",
          inflight);
    }
  }

  io_uring ring_;
  unsigned depth_;
  uint64_t chunk_;
  uint64_t fsync_serial_ = 0;
  uint64_t tag_ = 0;  // PidTag() of the Transfer in progress
  bool poisoned_ = false;
  FileIoCounters counters_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<FileIo>> FileIo::Create(std::string_view engine,
                                                       unsigned queue_depth, uint64_t chunk_bytes) {
  if (queue_depth < 1 || queue_depth > 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("queue depth %d is outside 1..4096", queue_depth));
  }
  if (chunk_bytes < 4096) {
    return absl::InvalidArgumentError(
        absl::StrFormat("I/O chunk of %d bytes is below 4096", chunk_bytes));
  }
  chunk_bytes = std::min(chunk_bytes, kMaxOpBytes);
  if (engine == "psync") return std::unique_ptr<FileIo>(new PsyncFileIo(chunk_bytes));
  if (engine != "uring") {
    return absl::InvalidArgumentError(
        absl::StrFormat("I/O engine \"%s\" is not uring or psync", engine));
  }
  io_uring ring;
  // One extra SQE per slot so cancellations always find room.
  int rc = io_uring_queue_init(queue_depth * 2, &ring, 0);
  if (rc < 0) {
    static bool logged = false;
    if (!logged) {
      logged = true;
      Log(LogLevel::kWarn, "io_uring unavailable (%s); using pread/pwrite", strerror(-rc));
    }
    return std::unique_ptr<FileIo>(new PsyncFileIo(chunk_bytes));
  }
  return std::unique_ptr<FileIo>(new UringFileIo(ring, queue_depth, chunk_bytes));
}

}  // namespace weightbus::internal
