// Pieces shared by the two planner loops (planner.cpp: replicated dp; dp_shard.cpp: dp-sharded
// sides): sender choice and turning the collected messages into the Plan's CSR arrays.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "planner/planner.h"

namespace real_py {

struct Holder {
  int64_t rank, offset;  // offset: flat offset of the holder's local tensor element 0
};

// Chooses senders: least egress first, preferring the receiver's node when nodes are known.
class SenderPicker {
 public:
  SenderPicker(int64_t num_ranks, int64_t ranks_per_node)
      : rank_load_(num_ranks, 0), rpn_(ranks_per_node),
        node_load_(ranks_per_node > 0 ? num_ranks / ranks_per_node + 1 : 1, 0) {}

  const Holder& pick(const std::vector<Holder>& holders, int64_t receiver, int64_t numel) {
    const Holder* best = nullptr;
    std::tuple<int, int64_t, int64_t, int64_t> best_key;
    for (const Holder& h : holders) {
      int remote = 0;
      int64_t node_load = 0;
      if (rpn_ > 0 && receiver >= 0) {
        remote = h.rank / rpn_ != receiver / rpn_;
        node_load = remote ? node_load_[h.rank / rpn_] : 0;
      }
      auto key = std::make_tuple(remote, node_load, rank_load_[h.rank], h.rank);
      if (!best || key < best_key) best = &h, best_key = key;
    }
    rank_load_[best->rank] += numel;
    if (rpn_ > 0) node_load_[best->rank / rpn_] += numel;
    return *best;
  }

 private:
  std::vector<int64_t> rank_load_;
  int64_t rpn_;
  std::vector<int64_t> node_load_;
};

// (sender, receivers) -> descriptors, and rank -> local descriptors, in deterministic order.
using MessageMap = std::map<std::pair<int64_t, std::vector<int64_t>>, std::vector<Desc>>;
using LocalMap = std::map<int64_t, std::vector<Desc>>;

// Collects every message and local copy (the whole plan).
class CollectSink : public PlanSink {
 public:
  MessageMap messages;
  LocalMap locals;
  void message(int64_t sender, const std::vector<int64_t>& receivers, const Desc& d) override {
    append_merged(messages[{sender, receivers}], d);
  }
  void local(int64_t rank, const Desc& d) override { append_merged(locals[rank], d); }
};

inline Plan assemble_plan(const MessageMap& messages, const LocalMap& locals) {
  Plan plan;
  for (const auto& [key, descs] : messages) {
    plan.msg_sender.push_back(key.first);
    plan.msg_receivers.insert(plan.msg_receivers.end(), key.second.begin(), key.second.end());
    plan.msg_recv_ptr.push_back(static_cast<int64_t>(plan.msg_receivers.size()));
    int64_t n = 0;
    for (const Desc& d : descs) n += d.numel();
    plan.descs.insert(plan.descs.end(), descs.begin(), descs.end());
    plan.msg_desc_ptr.push_back(static_cast<int64_t>(plan.descs.size()));
    plan.msg_numel.push_back(n);
  }
  plan.local_desc_ptr[0] = static_cast<int64_t>(plan.descs.size());  // locals follow messages
  for (const auto& [rank, descs] : locals) {
    plan.local_rank.push_back(rank);
    int64_t n = 0;
    for (const Desc& d : descs) n += d.numel();
    plan.descs.insert(plan.descs.end(), descs.begin(), descs.end());
    plan.local_desc_ptr.push_back(static_cast<int64_t>(plan.descs.size()));
    plan.local_numel.push_back(n);
  }
  return plan;
}

}  // namespace real_py
