// One model's pool: its replicas and its session and prefix tables, behind the pool's own mutex,
// and the four policies. The decisions are PythonRouter's, rule for rule: see its docstring.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "lru_table.h"

namespace laya {

// Same values as laya_core.routing.router.ReplicaState.
enum class ReplicaState : int { Up = 0, Draining = 1, Down = 2 };

// Spelt as in laya_core.routing.router.POLICIES.
enum class Policy { LeastOutstanding, RoundRobin, Session, Prefix };
std::optional<Policy> policy_named(std::string_view name);

// The model is unknown or has no replica up (Python: laya_core.routing.router.NoRouteError).
struct NoRoute : std::runtime_error {
    using std::runtime_error::runtime_error;
};

class Pool;

struct Replica {
    Replica(std::int64_t id, std::int64_t weight, Pool* pool) : id(id), weight(weight), pool(pool) {}

    bool is_up() const {
        return state.load(std::memory_order_relaxed) == static_cast<int>(ReplicaState::Up);
    }

    const std::int64_t id;
    const std::int64_t weight;
    Pool* const pool;
    // Atomics: release() and set_state() change them without taking the pool's mutex.
    std::atomic<int> state{static_cast<int>(ReplicaState::Up)};
    std::atomic<std::int64_t> num_outstanding{0};
    std::int64_t current_weight = 0;  // smooth weighted round robin's score; pool mutex
};

struct TableLimits {
    std::size_t session_capacity;
    std::optional<double> session_ttl_s;  // none: sessions only leave by LRU eviction
    std::size_t prefix_capacity;
};

class Pool {
public:
    Pool(std::string model, const TableLimits& limits, std::int64_t imbalance_threshold);

    const std::string model;

    void add(std::unique_ptr<Replica> replica);
    std::unique_ptr<Replica> remove(const Replica* replica);
    void set_policy(Policy policy, std::int64_t imbalance_threshold);

    // Choose a replica, count one more outstanding request on it and return its id. `name` is
    // what the request asked for (maybe an alias), for the error message.
    std::int64_t route(std::string_view name, std::optional<std::uint64_t> session_key,
                       const std::vector<std::uint64_t>& prefix);

private:
    struct Session {
        std::int64_t replica;
        double last_used_s;  // steady clock; 0 without a TTL
    };

    std::optional<std::size_t> least_outstanding() const;
    Replica& take(std::size_t index);
    Replica& smooth_weighted();
    Replica& by_session(std::size_t least, std::uint64_t session_key);
    Replica& by_prefix(std::size_t least, const std::vector<std::uint64_t>& prefix);
    Replica* up_member(std::int64_t replica) const;

    std::mutex mutex_;  // guards everything below; atomics in Replica excepted
    Policy policy_ = Policy::LeastOutstanding;
    std::int64_t imbalance_threshold_;
    std::vector<std::unique_ptr<Replica>> replicas_;  // insertion order: the round-robin order
    std::size_t cursor_ = 0;  // where the next least-outstanding scan starts
    const std::optional<double> session_ttl_s_;
    // Sessions are keyed by a 64-bit hash of the id, so an entry has a fixed size whatever the
    // id's length: the memory cap is capacity x at most 48 bytes (see lru_table.h).
    LruTable<Session> sessions_;
    LruTable<std::int64_t> prefixes_;  // block hash -> replica id
};

}  // namespace laya
