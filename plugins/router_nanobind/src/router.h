// The C++ router: the same decisions as laya_core.router.PythonRouter, kept free of Python so
// the table logic can be read (and later optimised) on its own. router_ext.cpp binds it.
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace laya {

// Same values as laya_core.router.ReplicaState.
enum class ReplicaState : int { Up = 0, Draining = 1, Down = 2 };

// A replica id that is not in the table (Python: KeyError).
struct UnknownReplica : std::out_of_range {
    explicit UnknownReplica(std::int64_t replica);
    std::int64_t replica;
};

// The model is unknown or has no replica up (Python: laya_core.router.NoRouteError).
struct NoRoute : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Bad argument or misuse (Python: ValueError) is reported with std::invalid_argument.

class Router {
public:
    void add_replica(const std::string& model, std::int64_t replica, std::int64_t weight);
    void remove_replica(std::int64_t replica);
    void set_state(std::int64_t replica, int state);
    std::int64_t route(const std::string& model);
    void release(std::int64_t replica);
    std::int64_t outstanding(std::int64_t replica) const;

private:
    struct Replica {
        std::string model;
        ReplicaState state = ReplicaState::Up;
        std::int64_t num_outstanding = 0;
        std::int64_t weight = 1;  // kept for a weighted policy; not used by the decision yet
    };
    struct Pool {
        std::vector<std::int64_t> replicas;  // insertion order: the round-robin order
        std::size_t cursor = 0;              // where the next tie-break scan starts
    };

    Replica& replica_at(std::int64_t replica);
    const Replica& replica_at(std::int64_t replica) const;

    // One lock over both tables: every operation is a few map look-ups, so a finer scheme
    // would cost more than it saves until profiling says otherwise.
    mutable std::mutex mutex_;
    std::unordered_map<std::string, Pool> pools_;
    std::unordered_map<std::int64_t, Replica> replicas_;
};

}  // namespace laya
