// The exact transfer planner. Torch-free, deterministic: every rank replays it and gets the
// same plan, so sends and receives pair up without a coordinator.
//
// For every destination rank, every element of its destination shard gets exactly one source:
// itself (a local copy, when it holds the element in the source layout) or one source rank.
// Senders are chosen to balance egress bytes over the source replicas holding the data
// (preferring the receiver's node, then the least-loaded node, when ranks_per_node is set);
// large pieces with more holders than receivers are split so that every holder sends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "planner/geometry.h"

namespace real_py {

// One side of a reallocation, as flat arrays (built by real_py/realloc/plan.py).
struct LayoutIn {
  int64_t dp = 1, tp = 1, pp = 1;
  std::vector<int64_t> grid;  // [pp][dp][tp] -> global rank
  // Shard entries: parameter `entry_param[i]` lives on stage `entry_stage[i]` at flat
  // offset `entry_offset[i]` (elements; the same on every tp rank of that stage).
  std::vector<int64_t> entry_param, entry_stage, entry_offset;
  // Data-parallel sharding (FSDP / ZeRO-3): empty, or [num_entries][dp][3] (lo, hi, offset):
  // dp replica d of entry i holds elements [lo, hi) of the entry's local tensor (row-major
  // flat index over [A, local_extent, B]) at flat offset `offset` of its buffer.
  std::vector<int64_t> entry_range;

  bool dp_sharded() const { return !entry_range.empty(); }
  // Per parameter, how this side stores it (Format); empty means all default (blocked, no
  // extra vocab padding, no replicated units).
  std::vector<int64_t> param_groups, param_vocab_multiple, param_replicate_units;

  Format format_of(std::size_t p) const {
    return {param_groups.empty() ? 0 : param_groups[p],
            param_vocab_multiple.empty() ? 1 : param_vocab_multiple[p],
            param_replicate_units.empty() ? 0 : param_replicate_units[p]};
  }

  int64_t rank(int64_t stage, int64_t d, int64_t t) const { return grid[(stage * dp + d) * tp + t]; }
};

enum class Mode : int { kP2P = 0, kBroadcast = 1 };

struct PlanOptions {
  Mode mode = Mode::kP2P;
  int64_t ranks_per_node = 0;        // 0: no node awareness
  int64_t min_split_elems = 1 << 18;  // split a piece over holders only above this size
};

// Messages in CSR form. Message m goes from msg_sender[m] to the receivers
// msg_receivers[msg_recv_ptr[m] .. msg_recv_ptr[m+1]) (one in p2p mode) and copies
// descs[msg_desc_ptr[m] .. msg_desc_ptr[m+1]) from the sender's source shard into every
// receiver's destination shard (receivers of one message have identical shard layouts).
// Local copy l moves descs[local_desc_ptr[l] .. local_desc_ptr[l+1]) within local_rank[l].
struct Plan {
  std::vector<int64_t> msg_sender, msg_recv_ptr{0}, msg_receivers, msg_desc_ptr{0}, msg_numel;
  std::vector<int64_t> local_rank, local_desc_ptr{0}, local_numel;
  std::vector<Desc> descs;
};

// Receives the plan's pieces as the planner loop produces them, in a deterministic order:
// message(sender, receivers, d) appends d to message (sender, receivers) (merged with its last
// descriptor when they continue each other); local(rank, d) likewise for rank's local copies.
// The full plan collects everything; a per-rank schedule keeps only sizes for other ranks.
class PlanSink {
 public:
  virtual ~PlanSink() = default;
  virtual void message(int64_t sender, const std::vector<int64_t>& receivers, const Desc& d) = 0;
  virtual void local(int64_t rank, const Desc& d) = 0;
};

// The planner loop itself (make_plan = plan_into + collecting sink); same checks and order.
void plan_into(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
               const PlanOptions& opt, PlanSink& sink);
void plan_dp_into(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
                  const PlanOptions& opt, PlanSink& sink);

// Throws std::invalid_argument on inconsistent input (a parameter held by no source shard,
// tp not dividing a block, ...).
Plan make_plan(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
               const PlanOptions& opt);

// The same plan when either side is dp-sharded (make_plan calls it); planner/dp_shard.cpp.
Plan make_plan_dp(const std::vector<ParamGeom>& params, const LayoutIn& src, const LayoutIn& dst,
                  const PlanOptions& opt);

}  // namespace real_py
