// One rank's share of a plan and of its bucket schedule, without the other ranks' descriptors.
//
// The rule is tests/support/schedule_oracle.py's (the global Python Schedule, the tests' reference): messages in the
// plan's order are cut into chunks (direct one-run pieces of a mixed message after its staged
// remainder), and each chunk goes to the earliest round where its sender can send it and its
// receivers can receive it, half the bucket per rank, round and direction (earliest fit). That placement only needs
// every message's chunk SIZES, so the planner loop runs as usual but keeps, for a message this
// rank is not part of, a size summary (numel, descriptor count, the sizes of its big one-run
// descriptors) instead of its descriptors. Sender and receivers of a chunk thus compute the
// same round and the same descriptors independently. Torch-free.
#pragma once

#include <cstdint>
#include <vector>

#include "planner/planner.h"

namespace real_py {

struct ScheduleOptions {
  int64_t round_elems = 1 << 20;   // per-rank budget per round (sends + receives), elements
  int64_t direct_min_elems = 0;    // 0: no direct splitting of mixed messages
};

struct RankSchedule {
  int64_t rank = 0, num_rounds = 0;
  // The global message table (sizes and peers only), in the plan's message order.
  std::vector<int64_t> msg_sender, msg_recv_ptr{0}, msg_receivers, msg_numel;
  std::vector<Desc> local;  // this rank's local copies
  // This rank's chunks, grouped by round (rounds ascending), sends before receives within a
  // round, each side in global chunk order. side: 0 send, 1 receive; slot: staging offset or
  // -1 (one contiguous run, straight from / into the shard buffer).
  std::vector<int64_t> chunk_msg, chunk_round, chunk_side, chunk_numel, chunk_slot,
      chunk_desc_ptr{0};
  std::vector<Desc> chunk_descs;
  // This rank's rounds: index, chunk range, pack / unpack descriptor ranges, staging size.
  std::vector<int64_t> round_index, round_chunk_ptr{0}, round_pack_ptr{0}, round_unpack_ptr{0},
      round_staging;
  std::vector<Desc> pack_descs, unpack_descs;
  // rank == -1: no rank's descriptors; every chunk's (msg, round, numel) in global chunk order
  // (what a simulator replays).
  std::vector<int64_t> all_msg, all_round, all_numel;
  int64_t summary_count = 0;  // messages known by size only (not this rank's)
  int64_t held_bytes = 0;     // peak bytes of the C++ data built (summaries + own descriptors + output)
};

RankSchedule make_rank_schedule(const std::vector<ParamGeom>& params, const LayoutIn& src,
                                const LayoutIn& dst, const PlanOptions& opt, int64_t rank,
                                const ScheduleOptions& sopt);

// Descriptors covering packed elements [lo, hi) of `descs` (runs concatenated in order).
std::vector<Desc> split_descs(const std::vector<Desc>& descs, int64_t lo, int64_t hi);

}  // namespace real_py
