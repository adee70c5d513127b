// SPDX-License-Identifier: Apache-2.0
#include "io/file_io.h"

#include <liburing.h>
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

class PsyncFileIo final : public FileIo {
 public:
  explicit PsyncFileIo(uint64_t chunk) : chunk_(chunk) {}
  std::string_view name() const override { return "psync"; }

  absl::Status Fsync(int fd, absl::Time deadline, std::string_view what) override {
    if (::fsync(fd) != 0) return ErrnoStatus(errno, absl::StrFormat("fsync %s", what));
    return absl::OkStatus();
  }

 private:
  absl::Status Transfer(bool write, absl::Span<const IoRequest> requests, absl::Time deadline,
                        absl::FunctionRef<void(size_t)> on_complete,
                        absl::FunctionRef<std::string(size_t)> describe) override {
    for (size_t i = 0; i < requests.size(); ++i) {
      const IoRequest& r = requests[i];
      uint64_t done = 0;
      while (done < r.length) {
        if (absl::Now() > deadline) return Deadline(write, describe(i), deadline);
        const uint64_t len = std::min({chunk_, r.length - done, kMaxOpBytes});
        ssize_t n = write ? ::pwrite(r.fd, r.buffer + done, len, r.file_offset + done)
                          : ::pread(r.fd, r.buffer + done, len, r.file_offset + done);
        if (n < 0) {
          if (errno == EINTR || errno == EAGAIN) continue;
          return ErrnoStatus(errno,
                             absl::StrFormat("%s: %s at file offset %d", describe(i),
                                             write ? "write" : "read", r.file_offset + done));
        }
        if (n == 0) return ShortTransfer(write, describe(i), r.file_offset + done, r.length - done);
        done += static_cast<uint64_t>(n);
      }
      on_complete(i);
    }
    return absl::OkStatus();
  }
  uint64_t chunk_;
};

class UringFileIo final : public FileIo {
 public:
  UringFileIo(io_uring ring, unsigned depth, uint64_t chunk)
      : ring_(ring), depth_(depth), chunk_(chunk) {}
  ~UringFileIo() override {
    if (!poisoned_) io_uring_queue_exit(&ring_);
  }
  std::string_view name() const override { return "uring"; }

  absl::Status Fsync(int fd, absl::Time deadline, std::string_view what) override {
    if (poisoned_) return Poisoned();
    const uint64_t tag = kFsyncTagBit | ++fsync_serial_;
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_fsync(sqe, fd, 0);
    io_uring_sqe_set_data64(sqe, tag);
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
    size_t request = 0;
    uint64_t offset = 0;  // within the request
    uint64_t length = 0;
    bool busy = false;
  };

  static absl::Status Poisoned() {
    return absl::InternalError(
        "io_uring instance unusable: operations from an earlier timed-out call never finished");
  }

  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (sqe == nullptr) {
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;  // non-null: the SQ has depth_ entries and we never queue more than that
  }

  // Submits queued SQEs and waits for one completion until `deadline`. Returns 0 with *cqe set,
  // -ETIME at the deadline, or another -errno.
  int SubmitAndWait(absl::Time deadline, io_uring_cqe** cqe) {
    int rc = io_uring_submit(&ring_);
    if (rc < 0 && rc != -EINTR && rc != -EBUSY && rc != -EAGAIN) return rc;
    absl::Duration left = std::max(deadline - absl::Now(), absl::ZeroDuration());
    __kernel_timespec ts;
    ts.tv_sec = absl::ToInt64Seconds(left);
    ts.tv_nsec = absl::ToInt64Nanoseconds(left - absl::Seconds(ts.tv_sec));
    return io_uring_wait_cqe_timeout(&ring_, cqe, &ts);
  }

  void Issue(bool write, const IoRequest& r, size_t slot_index, const Slot& slot) {
    io_uring_sqe* sqe = GetSqe();
    if (write) {
      io_uring_prep_write(sqe, r.fd, r.buffer + slot.offset, static_cast<unsigned>(slot.length),
                          r.file_offset + slot.offset);
    } else {
      io_uring_prep_read(sqe, r.fd, r.buffer + slot.offset, static_cast<unsigned>(slot.length),
                         r.file_offset + slot.offset);
    }
    io_uring_sqe_set_data64(sqe, slot_index);
  }

  absl::Status Transfer(bool write, absl::Span<const IoRequest> requests, absl::Time deadline,
                        absl::FunctionRef<void(size_t)> on_complete,
                        absl::FunctionRef<std::string(size_t)> describe) override {
    if (poisoned_) return Poisoned();
    std::vector<Slot> slots(depth_);
    std::vector<size_t> free_slots;
    for (size_t i = depth_; i-- > 0;) free_slots.push_back(i);
    std::vector<uint64_t> remaining(requests.size());
    for (size_t i = 0; i < requests.size(); ++i) remaining[i] = requests[i].length;

    size_t next_request = 0;
    uint64_t next_offset = 0;
    unsigned inflight = 0;
    absl::Status error;

    while (true) {
      while (error.ok() && !free_slots.empty() && next_request < requests.size()) {
        const IoRequest& r = requests[next_request];
        if (r.length == 0) {
          on_complete(next_request++);
          continue;
        }
        const size_t s = free_slots.back();
        free_slots.pop_back();
        const uint64_t len = std::min({chunk_, r.length - next_offset, kMaxOpBytes});
        slots[s] = Slot{next_request, next_offset, len, true};
        Issue(write, r, s, slots[s]);
        ++inflight;
        next_offset += len;
        if (next_offset == r.length) {
          ++next_request;
          next_offset = 0;
        }
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
            culprit = s.request;
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
        const uint64_t data = io_uring_cqe_get_data64(cqe);
        if (data >= slots.size() || !slots[data].busy) continue;  // cancel or abandoned op
        Slot& slot = slots[data];
        const IoRequest& r = requests[slot.request];
        const int res = cqe->res;
        if (res == -EAGAIN || res == -EINTR) {
          if (error.ok()) {
            Issue(write, r, data, slot);
            continue;
          }
        } else if (res < 0) {
          if (error.ok()) {
            error = ErrnoStatus(
                -res, absl::StrFormat("%s: %s at file offset %d", describe(slot.request),
                                      write ? "write" : "read", r.file_offset + slot.offset));
          }
        } else if (res == 0) {
          if (error.ok()) {
            error = ShortTransfer(write, describe(slot.request), r.file_offset + slot.offset,
                                  remaining[slot.request]);
          }
        } else {
          const uint64_t n = static_cast<uint64_t>(res);
          remaining[slot.request] -= n;
          if (n < slot.length && error.ok()) {  // short transfer: issue the rest
            slot.offset += n;
            slot.length -= n;
            Issue(write, r, data, slot);
            continue;
          }
          if (remaining[slot.request] == 0) on_complete(slot.request);
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
      io_uring_prep_cancel64(sqe, i, 0);
      io_uring_sqe_set_data64(sqe, kCancelTag);
    }
    const absl::Time grace = absl::Now() + absl::Seconds(5);
    while (inflight > 0) {
      io_uring_cqe* cqe = nullptr;
      int rc = SubmitAndWait(grace, &cqe);
      if (rc == -EINTR) continue;
      if (rc < 0) break;
      const uint64_t data = io_uring_cqe_get_data64(cqe);
      io_uring_cqe_seen(&ring_, cqe);
      if (data < slots.size() && slots[data].busy) {
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
  bool poisoned_ = false;
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
