// The C++ router: the same decisions as laya_core.routing.router.PythonRouter, kept free of Python so
// the table logic can be read on its own. router_ext.cpp binds it.
//
// Locks. route() takes a shared lock on one of 16 name shards (model name -> pool), drops it,
// then the pool's mutex; release() and outstanding() take the mutex of one of 16 replica shards
// (id -> replica) and touch an atomic count. So requests for different models, or releases of
// different replicas, never meet on a lock. Table changes (add, remove, alias, policy, state)
// are serialised by admin_mutex_, which the request path never takes. Lock order: admin, name
// shard, pool, replica shard. Pools are never freed before the router and names never change
// meaning once added, so a Pool* found under a shard lock stays valid after it is dropped.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pool.h"

namespace laya {

// A replica id that is not in the table (Python: KeyError).
struct UnknownReplica : std::out_of_range {
    explicit UnknownReplica(std::int64_t replica);
    std::int64_t replica;
};

// Bad argument or misuse (Python: ValueError) is reported with std::invalid_argument.

class Router {
public:
    Router(std::int64_t session_capacity, std::optional<double> session_ttl_s,
           std::int64_t prefix_capacity, std::int64_t imbalance_threshold);

    void add_replica(std::string_view model, std::int64_t replica, std::int64_t weight);
    void remove_replica(std::int64_t replica);
    void set_state(std::int64_t replica, int state);
    void add_alias(std::string_view alias, std::string_view model);
    void set_policy(std::string_view model, std::string_view policy,
                    std::optional<std::int64_t> imbalance_threshold);
    std::int64_t route(std::string_view model, std::optional<std::string_view> session,
                       const std::vector<std::uint64_t>& prefix);
    void release(std::int64_t replica);
    std::int64_t outstanding(std::int64_t replica) const;

private:
    static constexpr std::size_t kNumShards = 16;

    struct Name {
        std::string text;
        Pool* pool;  // an alias shares its model's pool
        bool is_alias;
    };
    // alignas: shards written by different threads do not share a cache line.
    struct alignas(64) NameShard {
        mutable std::shared_mutex mutex;
        // Keyed by the name's hash, so a look-up needs no std::string (C++17 has no
        // heterogeneous look-up in unordered maps); equal hashes are told apart by `text`.
        std::unordered_multimap<std::size_t, Name> names;
    };
    struct alignas(64) ReplicaShard {
        mutable std::mutex mutex;
        std::unordered_map<std::int64_t, Replica*> replicas;  // owned by their pool
    };
    struct Shards {
        std::array<NameShard, kNumShards> names;
        std::array<ReplicaShard, kNumShards> replicas;
    };

    const Name* find_name(std::string_view name) const;
    Pool& create_pool(std::string_view model);
    Replica& replica_at(const ReplicaShard& shard, std::int64_t replica) const;
    ReplicaShard& replica_shard(std::int64_t replica) const;

    const TableLimits limits_;
    const std::int64_t imbalance_threshold_;
    // On the heap, where `new` honours alignas (nanobind places the Router itself).
    const std::unique_ptr<Shards> shards_ = std::make_unique<Shards>();
    std::mutex admin_mutex_;                     // serialises table changes
    std::vector<std::unique_ptr<Pool>> pools_;  // admin_mutex_; only grows
};

}  // namespace laya
